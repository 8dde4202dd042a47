"""The advantage rows of ``packloss bench peers``: GAE over a packed bin (:func:`packloss.gae_advantages`)
beside verl's own ``compute_gae_advantage_return`` (a loop over the time steps of the padded batch) on
the same sequences, checked equal before timing. ``docs/benchmarks.md``, "How the suites measure"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from packloss.core.advantages import gae_advantages
from packloss.tools.bench._measure import check, import_peer
from packloss.tools.bench.loss import _interleaved_ms
from packloss.tools.bench.peers_rl import RL_EXACT_RTOL, RLBatch, rl_batch

__all__ = ["GAMMA", "LAM", "WHITENED_RTOL", "run_gae"]

GAMMA, LAM = 0.99, 0.95
WHITENED_RTOL = 1e-6
_COMPARISON = "gae·verl"


def _values(b: RLBatch) -> tuple[Tensor, Tensor]:
    """Padded ``[B, T]`` rewards (the sequence's advantage on its last member, as an outcome reward)
    and values (the old log-probs standing in for a critic's output)."""
    last_member = b.mask.shape[1] - 1 - b.mask.flip(1).long().argmax(1)  # [B]: every row has a member
    last = torch.zeros_like(b.mask).scatter_(1, last_member[:, None], True)  # [B, T]
    rewards = torch.where(last, b.adv[:, None].expand_as(b.mask), 0.0)  # [B, T]
    return rewards, torch.where(b.valid, b.old, 0.0)


def _steps(b: RLBatch, core_algos: Any) -> dict[str, Callable[[], tuple[Tensor, Tensor]]]:
    """``{"packloss": (advantages, returns) [N] each, "verl": [B, T] each}`` on the batch, both whitening."""
    rewards, values = _values(b)
    packed = (b.packed(rewards), b.packed(values), b.seq_lens, b.packed(b.mask))
    mask = b.mask.long()  # verl's response mask
    return {
        "packloss": lambda: gae_advantages(*packed, gamma=GAMMA, lam=LAM, whiten=True),
        "verl": lambda: core_algos.compute_gae_advantage_return(rewards, values, mask, GAMMA, LAM),
    }


def run_gae(shapes: list[tuple[int, int]], warmup: int, repeat: int, progress, notes: list[str]) -> list[dict]:
    """At each ``(tokens, sequences)`` shape: packloss's packed GAE and verl's, both whitening the
    advantages, checked in float64 at the members (returns to
    :data:`~packloss.tools.bench.peers_rl.RL_EXACT_RTOL`, whitened advantages to :data:`WHITENED_RTOL`:
    verl's Bessel factor is float32), then timed round-robin in float32."""
    core_algos, why = import_peer("verl.trainer.ppo.core_algos")
    if core_algos is None:
        notes.append(f"{_COMPARISON}: {why}")
        return []
    rows = []
    for num_tokens, num_seqs in shapes:
        progress(f"peers {_COMPARISON} N={num_tokens} S={num_seqs}")
        b = rl_batch(num_tokens, num_seqs)
        b64 = b.to(torch.float64)
        (adv, ret), (verl_adv, verl_ret) = (step() for step in _steps(b64, core_algos).values())
        members = b64.packed(b64.mask)
        check(f"{_COMPARISON} returns", ret[members], verl_ret[b64.mask], RL_EXACT_RTOL)
        check(f"{_COMPARISON} advantages", adv[members], verl_adv[b64.mask], WHITENED_RTOL)
        times = _interleaved_ms(_steps(b, core_algos), "cpu", warmup, repeat)
        shape = f"N={num_tokens} B×T={b.valid.shape[0]}×{b.valid.shape[1]}"
        for variant, t in times.items():
            row = {"comparison": _COMPARISON, "shape": shape, "variant": variant, "time_ms": t, "peak_bytes": None}
            if variant == "packloss":
                row["vs_verl"] = t / times["verl"]
            rows.append(row)
    return rows
