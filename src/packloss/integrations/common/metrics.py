"""Metric names as data: a peer's metric is the sum of packloss metrics with its meaning, listed in a
table per adapter; the rest keep packloss's names under a prefix."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor

__all__ = ["RenameTable", "component_metrics", "peer_metrics"]

RenameTable = Mapping[str, Sequence[str]]
"""``{peer name: (packloss metric, ...)}``: the peer's metric is the sum of the listed ones; an empty
tuple is a metric the peer reports as a constant 0 (no packloss counterpart)."""


def component_metrics(metrics: Mapping[str, Tensor], component: str) -> dict[str, Tensor]:
    """The metrics of ``component`` without its ``"{component}/"`` prefix, detached."""
    prefix = f"{component}/"
    return {k[len(prefix) :]: v.detach() for k, v in metrics.items() if k.startswith(prefix)}


def peer_metrics(own: Mapping[str, Tensor], table: RenameTable, rest: str | None = None) -> dict[str, Tensor]:
    """``{peer name: Σ own[source]}`` for every row of ``table`` whose sources ``own`` all has (0 for a
    row without sources), then
    (``rest`` given) every metric of ``own`` as ``rest + name``."""
    out: dict[str, Tensor] = {}
    for peer, sources in table.items():
        if not sources and own:
            out[peer] = next(iter(own.values())).new_zeros(())
        elif sources and all(s in own for s in sources):
            total = own[sources[0]]
            for s in sources[1:]:
                total = total + own[s]
            out[peer] = total
    if rest is not None:
        out.update({f"{rest}{k}": v for k, v in own.items()})
    return out
