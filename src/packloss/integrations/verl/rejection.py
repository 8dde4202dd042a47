"""verl's rejection sampling (``algorithm.rollout_correction.rollout_rs``) on a packed bin: the member
mask verl trains on after its decoupled rejection, and the parsing of its criteria."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from packloss.core import checks
from packloss.core.layout import Layout
from packloss.integrations.common.config import ConfigReader

__all__ = ["RS_OPTIONS", "rs_thresholds", "rejection_mask"]

RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")  # fmt: skip
"""verl's rejection-sampling criteria (``rollout_rs``, comma-separated; all must pass)."""
_RS_SAFETY = 20.0  # verl clamps the log-ratio of its rollout correction to [−20, 20]


def _float(text: str, option: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(
            f"rollout_correction.rollout_rs_threshold for {option!r} must be a number, got {text!r}"
        ) from None


def rs_thresholds(rollout_rs: Any, spec: Any) -> list[tuple[str, float | None, float]]:
    """verl's ``rollout_rs`` options with their ``(lower, upper)`` thresholds, in verl's parsing:
    ``*_k1`` takes ``"l_u"`` ratio bounds (a single ``u`` means ``l = 1/u``), the others an upper bound."""
    if not isinstance(rollout_rs, str) or not rollout_rs.strip():
        raise ValueError(
            f"rollout_correction.rollout_rs must be a non-empty string of {RS_OPTIONS}, got {rollout_rs!r}"
        )
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    for option in options:
        if option not in RS_OPTIONS:
            raise NotImplementedError(f"rollout_rs={option!r} is not a verl option ({RS_OPTIONS})")
    if spec is None:
        raise ValueError("rollout_correction.rollout_rs needs rollout_rs_threshold, got None")
    specs = [str(spec)] if isinstance(spec, int | float) else [s.strip() for s in str(spec).split(",") if s.strip()]
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ValueError(f"rollout_correction.rollout_rs_threshold needs 1 or {len(options)} thresholds, got {spec!r}")
    out = []
    for option, text in zip(options, specs, strict=True):
        if option.endswith("k1"):
            parts = text.split("_", 1)
            lower, upper = (
                (_float(v, option) for v in parts)
                if len(parts) == 2
                else (1 / _float(text, option), _float(text, option))
            )
            if not 0 < lower <= upper:
                raise ValueError(f"rollout_rs_threshold for {option!r} must be 0 < lower <= upper, got {text!r}")
            out.append((option, lower, upper))
        else:
            upper = _float(text, option)
            if not upper > 0:
                raise ValueError(f"rollout_rs_threshold for {option!r} must be > 0, got {text!r}")
            out.append((option, None, upper))
    return out


def rejection_mask(
    rollout_correction: Any,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    seq_lens: Sequence[int] | Layout,
) -> Tensor:
    """The member mask verl trains on after its decoupled rejection sampling: ``mask & keep``.

    With ``x_t = clamp(old_t − rollout_t, −20, 20)`` and per token ``k1 = −x``, ``k2 = ½x²``,
    ``k3 = eˣ − 1 − x``: ``token_kj`` keeps a token by its own value, ``seq_sum_kj`` / ``seq_mean_kj`` /
    ``seq_max_kj`` a whole sequence by the sum / mean / max over its members; ``*_k1`` keeps
    ``log l ≤ value ≤ log u``, the others ``value ≤ u``. Every listed criterion must pass. ``mask [N]``
    bool; ``old_logprobs``, ``rollout_logprobs`` ``[N]``; ``mask`` itself when ``rollout_rs`` is None.
    No host read; the op count does not depend on the number of sequences.
    """
    r = ConfigReader(rollout_correction, "rollout_correction")
    rs = r.get("rollout_rs", None)
    if rs is None:
        return mask
    options = rs_thresholds(rs, r.get("rollout_rs_threshold", None))
    checks.tensor("mask", mask, boolean=True)
    layout = seq_lens if isinstance(seq_lens, Layout) else Layout.build(seq_lens, mask.device)
    checks.tensor("mask", mask, shape=(layout.num_tokens,))
    segments = layout.segments
    old = torch.where(mask, old_logprobs.detach(), 0.0)
    rollout = torch.where(mask, rollout_logprobs.detach(), 0.0)
    x = (old - rollout).clamp(-_RS_SAFETY, _RS_SAFETY)  # [N], 0 off the members
    per_token = {"k1": -x, "k2": 0.5 * x**2, "k3": torch.exp(x) - 1 - x}
    keep = torch.ones_like(mask)
    count = None
    for option, lower, upper in options:
        kind = option[-2:]
        value = torch.where(mask, per_token[kind], 0.0)  # [N]
        if option.startswith("seq_sum") or option.startswith("seq_mean"):
            seq = segments.sum(value)  # [S]
            if option.startswith("seq_mean"):
                if count is None:
                    count = segments.count(mask).to(value.dtype).clamp_min(1)  # [S]
                seq = seq / count
            value = segments.broadcast(seq)  # [N]
        elif option.startswith("seq_max"):
            value = segments.broadcast(segments.max(value, mask))  # [N]
        if kind == "k1":
            passed = (value >= math.log(lower)) & (value <= math.log(upper))
        else:
            passed = value <= upper
        keep = keep & passed
    return mask & keep
