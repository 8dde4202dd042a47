"""The ``rl head`` rows of ``packloss bench peers``: PPO clip (0.2, token mean over the members) from
hidden states through the LM head — packloss's one pass (``FusedObjective``) and two-step path
(``linear_logprobs`` then ``compute_loss``), cut-cross-entropy's ``torch_compile`` log-probs under the
same loss written plainly, Liger's ``LigerFusedLinearGRPOLoss`` (``bnpo``: the same token mean) and a
naive materialised loss. ``docs/benchmarks.md``, "RL through the head"."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from packloss.core.bin import Component, Plan
from packloss.core.engine import compute_loss
from packloss.core.outputs import Outputs
from packloss.core.pg import PolicyGradient
from packloss.tools.bench._measure import import_peer
from packloss.vocab.fused_objective import FusedObjective
from packloss.vocab.head import linear_logprobs

__all__ = ["RL_HEAD_VARIANTS", "ROW_TOKENS", "rl_head_inputs", "rl_head_fn"]

RL_HEAD_VARIANTS = {
    "naive_eager": None,
    "naive_compiled": None,
    "packloss_one_pass": None,
    "packloss_two_step": None,
    "cce_torch_compile": "cut_cross_entropy",
    "liger_grpo_compiled": "liger_kernel.chunked_loss",
}
ROW_TOKENS = 256  # tokens per sequence (one padded row for Liger); the first eighth of each is prompt
_CLIP = 0.2

RLHeadInputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]  # hidden, weight, labels, mask, adv, old


def rl_head_inputs(n: int, h: int, v: int, device: str, seed: int) -> RLHeadInputs:
    """``hidden [N, H]``, ``weight [V, H]`` (both requiring grad), ``labels [N]``, ``mask [N]``, per-token
    ``advantages [N]`` (one per sequence of :data:`ROW_TOKENS`) and ``old_logprobs [N]`` within ±0.3 of
    the head's own log-probs, so that some ratios clip."""
    g = torch.Generator().manual_seed(seed)
    rows = max(n // ROW_TOKENS, 1)
    hidden = torch.randn(n, h, generator=g) * 0.5
    weight = torch.randn(v, h, generator=g) * 0.05
    labels = torch.randint(0, v, (n,), generator=g)
    row = n // rows  # tokens per sequence: ROW_TOKENS, or all of a smaller bin
    mask = (torch.arange(n) % row) >= row // 8
    adv = torch.repeat_interleave(torch.randn(rows, generator=g), row)
    with torch.no_grad():
        spans = [slice(i, i + ROW_TOKENS) for i in range(0, n, ROW_TOKENS)]
        lp = torch.cat([_naive_logprobs(hidden[s], weight, labels[s]) for s in spans])
    old = lp + (torch.rand(n, generator=g) - 0.5) * 0.6
    to = lambda t: t.to(device)
    return to(hidden).requires_grad_(), to(weight).requires_grad_(), to(labels), to(mask), to(adv), to(old)


def _naive_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
    return torch.log_softmax(hidden @ weight.T, -1).gather(1, labels[:, None]).squeeze(1)


def _ppo_token_mean(lp: Tensor, mask: Tensor, adv: Tensor, old: Tensor) -> Tensor:
    """``Σ_members −min(r A, clip(r, 1 ± ε) A) / #members``, ``r = exp(lp − old)``."""
    r = torch.exp(lp - old)
    per_token = -torch.minimum(r * adv, r.clamp(1 - _CLIP, 1 + _CLIP) * adv)
    return torch.where(mask, per_token, 0.0).sum() / mask.sum().clamp(min=1)


def _naive(hidden: Tensor, weight: Tensor, labels: Tensor, mask: Tensor, adv: Tensor, old: Tensor) -> Tensor:
    return _ppo_token_mean(_naive_logprobs(hidden, weight, labels), mask, adv, old)


def _plan(n: int, objective: object, mask: Tensor, adv: Tensor, old: Tensor) -> Plan:
    rows = max(n // ROW_TOKENS, 1)
    components = {"rl": Component(objective, mask)}
    return Plan(seq_lens=[n // rows] * rows, components=components, old_logprobs=old, advantages=adv)


def rl_head_fn(variant: str) -> Callable[..., Tensor]:
    """``(hidden, weight, labels, mask, advantages, old_logprobs) -> loss`` (0-d) of one variant; packloss's
    build their plan in the call, as a trainer does per micro-batch."""
    if variant == "naive_eager":
        return _naive
    if variant == "naive_compiled":
        return torch.compile(_naive)
    if variant == "packloss_one_pass":
        objective = FusedObjective(PolicyGradient("ppo_clip"))

        def one_pass(hd: Tensor, w: Tensor, y: Tensor, m: Tensor, adv: Tensor, old: Tensor) -> Tensor:
            outputs = Outputs(hidden=hd, head_weight=w, labels=y)
            return compute_loss(_plan(hd.shape[0], objective, m, adv, old), outputs).loss

        return one_pass
    if variant == "packloss_two_step":
        objective = PolicyGradient("ppo_clip")

        def two_step(hd: Tensor, w: Tensor, y: Tensor, m: Tensor, adv: Tensor, old: Tensor) -> Tensor:
            lp, _ = linear_logprobs(hd, w, y, return_entropy=False)
            return compute_loss(_plan(hd.shape[0], objective, m, adv, old), Outputs(logprobs=lp)).loss

        return two_step
    if variant == "cce_torch_compile":
        cce, _ = import_peer("cut_cross_entropy", "linear_cross_entropy")

        def cce_ppo(hd: Tensor, w: Tensor, y: Tensor, m: Tensor, adv: Tensor, old: Tensor) -> Tensor:
            lp = -cce(hd, w, y, impl="torch_compile", reduction="none")
            return _ppo_token_mean(lp, m, adv, old)

        return cce_ppo
    if variant == "liger_grpo_compiled":
        grpo, _ = import_peer("liger_kernel.chunked_loss", "LigerFusedLinearGRPOLoss")
        liger = grpo(beta=0.0, use_ref_model=False, loss_type="bnpo", epsilon_low=_CLIP, epsilon_high=_CLIP)

        def liger_ppo(hd: Tensor, w: Tensor, y: Tensor, m: Tensor, adv: Tensor, old: Tensor) -> Tensor:
            rows = max(hd.shape[0] // ROW_TOKENS, 1)
            shape = (rows, hd.shape[0] // rows)
            out = liger(hd.view(*shape, -1), w, y.view(shape), m.view(shape).long(), adv.view(shape)[:, 0],
                        old_per_token_logps=old.view(shape))  # fmt: skip
            return out[0] if isinstance(out, tuple) else out

        return liger_ppo
    raise ValueError(f"rl_head_fn: unknown variant {variant!r}; choose from {tuple(RL_HEAD_VARIANTS)}")
