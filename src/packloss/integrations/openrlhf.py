"""packloss.integrations.openrlhf: a drop-in for OpenRLHF 0.11.2's ``openrlhf.models.loss.PolicyLoss``.

:class:`PolicyLoss` takes OpenRLHF's constructor arguments, ``forward`` signature and return value
(``loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio``) and computes the loss with packloss's engine:
the padded ``[B, T]`` tensors are packed with :class:`~packloss.PaddedLayout` into one bin, the loss is
a :class:`~packloss.PolicyGradient` in a :class:`~packloss.Plan`, and :func:`~packloss.compute_loss`
reduces it. OpenRLHF is not imported. Swap it in where OpenRLHF's actor builds its loss::

    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from packloss.integrations.openrlhf import PolicyLoss

    ppo_actor.PolicyLoss = PolicyLoss   # in the actor's process, before the trainer is built

OpenRLHF's per-token loss (``r_t`` its ratio, ``A_t`` the advantage, members ``m``)::

    ppo    r_t = exp(clamp(log π_θ − log π_old, −20, 20))
    gspo   r_t = s_i = exp(mean_{u∈i} (log π_θ − log π_base))   (π_base = π_rollout with a correction
                                                                on, else π_old; full gradient of s_i)
    J_t    = min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t);  dual clip c, A_t < 0: max(J_t, c A_t)
    ℓ_t    = −J_t · c_t      (c_t the train/rollout correction, ppo only; 1 when off)

Mapping onto packloss:

===================================  =====================================================================
OpenRLHF                             packloss
===================================  =====================================================================
``policy_loss_type="ppo"``           :class:`ClampedPPOClip` (``PPOClip`` on the clamped ratio),
                                     ``ratio="old"``
``policy_loss_type="gspo"``          :class:`SequenceRatioClip` (``PPOClip`` on ``s_i``);
                                     ``ratio="rollout"`` when ``is_correction_level != "off"``
``clip_eps_low/high``, ``dual_clip`` ``clip_low``, ``clip_high``, ``dual_clip_c``
correction token / clip / ratio      ``RolloutCorrection("token", "truncate", high, low)`` (TIS)
correction token / mask / ratio      ``RolloutCorrection("token", "mask", high, low)`` (ICEPOP)
correction seq / mask / ratio        :class:`GatedCorrection` ``("sequence", gating="ratio")``
correction * / mask / binary_kl, tv  :class:`GatedCorrection` ``(level, gating=...)``
token-level, no ``batch_num_tokens`` ``Normalize.TOKEN`` (this micro-batch's member tokens)
token-level, ``batch_num_tokens``    ``Normalize.CONSTANT``, ``C = batch_num_tokens / dp_size``
seq-level, no ``global_batch_size``  ``Normalize.SEQUENCE_MEAN`` (this micro-batch's non-empty rows)
seq-level, ``global_batch_size``     weights ``1 / n_s``, ``Normalize.CONSTANT``,
                                     ``C = global_batch_size / dp_size``
===================================  =====================================================================

``gating="ratio"`` reads ``ρ = π_old / π_rollout`` per token or its geometric mean per sequence;
``binary_kl`` / ``tv`` the sampled-token divergence between π_rollout and π_old (their probabilities
clamped to ``[1e-6, 1 − 1e-6]``), per token or its mean per sequence. ``mask`` keeps ``ρ_t`` on the
kept units and zeroes the others; ``clip`` (token ratio only) weights by ``clamp(ρ_t, low, high)``.

Where this differs from OpenRLHF (``tests/integrations/test_openrlhf.py`` asserts each):

* **No member at all.** OpenRLHF's means divide by zero (``loss``, ``clip_ratio``, ``ppo_kl`` and the
  seq-level means are NaN when the micro-batch has no action token); packloss clamps every count to at
  least 1, so they are 0. A ``batch_num_tokens`` / ``global_batch_size`` number ``<= 0`` is a
  ``ValueError`` (a tensor's value is not read).
* **Non-member values.** OpenRLHF multiplies by the mask, so inf or NaN on a padding position makes its
  loss NaN; here they never enter (packloss masks with ``where``).
* **dtypes.** The loss and ``ppo_kl`` / ``vllm_kl`` are computed in at least float32 (OpenRLHF: the
  input's dtype, e.g. bf16); ``clip_ratio`` and ``is_filter_ratio`` are float32, as OpenRLHF's with an
  integer or bool mask. Only ``log_probs`` carries a gradient (the other streams are detached).
* **action_mask.** Nonzero is a member (OpenRLHF's masks are 0/1 integers or bools); None is every
  position. A floating-point mask raises ``NotImplementedError``: OpenRLHF would weight tokens by it
  and add its ``+ 1e-8`` to a float row count, neither of which is mapped.
* **Settings** are validated at construction: ``clip_eps_low`` in ``[0, 1)``, a correction threshold
  with ``low < high`` and ``high > 0`` (OpenRLHF accepts an empty band), an unknown
  ``policy_loss_type`` (OpenRLHF: at the first ``forward``); ``dual_clip <= 1`` is a ``ValueError``
  (OpenRLHF: an ``AssertionError``).

Reproduced as OpenRLHF computes it: a row without action tokens is not counted by the seq-level means,
but counts as *filtered* in the seq-level ``is_filter_ratio`` (OpenRLHF's gate reads NaN for it), whose
denominator is every row ``B``.

Packing: ``packing="members"`` (default) packs each row's action tokens (a row without any keeps one
non-member token, so it stays a sequence); reading the row lengths is one device→host sync per call.
``packing="rows"`` packs every position of every row (``N = B·T``): no sync, more tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from packloss.core.bin import ComponentLoss, upcast
from packloss.core.corrections import RolloutCorrection
from packloss.core.engine import compute_loss
from packloss.core.layout import PaddedLayout
from packloss.core.bin import Normalize
from packloss.core.pg import PolicyGradient
from packloss.core.bin import Component, Outputs, Plan
from packloss.core.segments import broadcast, segment_count, segment_mean
from packloss.core.trust_regions import PolicyTerms, PPOClip, Surrogate

__all__ = [
    "OPENRLHF_VERSION",
    "PolicyLoss",
    "ClampedPPOClip",
    "SequenceRatioClip",
    "GatedCorrection",
    "policy_gradient",
    "aggregate_component",
]

OPENRLHF_VERSION = "0.11.2"
"""The OpenRLHF release whose ``PolicyLoss`` this module reproduces (and its tests run against)."""

POLICY_LOSS_TYPES = ("ppo", "gspo")
IS_LEVELS = ("off", "token", "seq")
IS_MODES = ("mask", "clip")
IS_GATINGS = ("ratio", "binary_kl", "tv")
PACKINGS = ("members", "rows")

_COMPONENT = "pg"
_LOG_RATIO_CLAMP = 20.0  # OpenRLHF's "ppo" clamps log r to [−20, 20] before exp
_PROB_CLAMP = 1e-6  # OpenRLHF clamps the probabilities of its divergence gates to [1e-6, 1 − 1e-6]


# ---------------------------------------------------------------------------------------------------
# Trust regions: OpenRLHF's two ratios under PPO's (dual) clip
# ---------------------------------------------------------------------------------------------------


def _clip_surrogate(region: PPOClip, t: PolicyTerms, ratio: Tensor, sequence_ratio=None) -> Surrogate:
    """``PPOClip.clipped`` of ``ratio [N]`` plus OpenRLHF's ``clip_ratio`` metric: members whose clipped
    surrogate is the smaller, ``clip(r)·A < r·A`` (the same comparison as OpenRLHF's)."""
    surrogate, metrics = region.clipped(ratio, t.a)
    r = ratio.detach()
    metrics["clip_ratio"] = r.clamp(1 - region.clip_low, 1 + region.clip_high) * t.a < r * t.a
    return Surrogate(torch.where(t.m, surrogate, 0.0), metrics, sequence_ratio=sequence_ratio)


@dataclass(frozen=True)
class ClampedPPOClip(PPOClip):
    """PPO's clip (with dual clip) on ``r = exp(clamp(log_r, −20, 20))``: OpenRLHF's ``"ppo"``.

    Differs from :class:`~packloss.core.trust_regions.PPOClip` only where ``|log_r| > 20``: there ``r``
    is ``e^±20`` with no gradient. Metric ``clip_ratio`` (OpenRLHF's): members with
    ``clip(r)·A < r·A``. Not registered (OpenRLHF's own semantics, not a new objective).
    """

    name: ClassVar[str] = "openrlhf_ppo"

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        ratio = torch.exp(t.log_r.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))  # [N]
        return _clip_surrogate(self, t, ratio)


@dataclass(frozen=True)
class SequenceRatioClip(PPOClip):
    """PPO's clip (with dual clip) on the sequence ratio, with its full gradient: OpenRLHF's ``"gspo"``::

        s_i = exp(Σ_{t∈i} log r_t / max(n_i, 1)),   J_t = min(s_i A_t, clip(s_i, 1−ε_low, 1+ε_high) A_t)

    ``∇s_i = s_i · mean_{u∈i} ∇log π_θ(y_u)``, so every token's term moves every member of its
    sequence. GSPO-token (:class:`~packloss.core.trust_regions.GSPO`) detaches ``s_i`` and gives each
    token its own ``∇log π_θ``: the two gradients agree only when ``A`` (and the clip decision) is the
    same on every token of a sequence. No clamp. Metrics ``clip_ratio`` and ``seq_ratio_*``.
    """

    name: ClassVar[str] = "openrlhf_gspo"

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        seq_log_r, count = segment_mean(t.log_r, t.m, t.seq_ids, t.num_seqs)  # [S], differentiable
        seq_ratio = torch.exp(seq_log_r)  # [S]
        ratio = broadcast(seq_ratio, t.seq_ids)  # [N]
        return _clip_surrogate(self, t, ratio, sequence_ratio=(seq_ratio.detach(), count > 0))


# ---------------------------------------------------------------------------------------------------
# The train/rollout correction whose gate is not its weight
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GatedCorrection(RolloutCorrection):
    """A masking rollout correction that gates on one statistic and weights by the token ratio
    (OpenRLHF's ``is_correction_*`` with ``mode="mask"``)::

        log ρ_t = where(m, old − inf, 0)       (the numerator as RolloutCorrection's: old, or sg(trn))
        g_u     = ρ_t                                    gating="ratio",     level="token"
                | exp(mean_{t∈i} log ρ_t)                gating="ratio",     level="sequence"
                | D_t  or  mean_{t∈i} D_t                gating="binary_kl" / "tv"
        D_t     = p log(p/q) + (1−p) log((1−p)/(1−q))    (binary_kl)   |   |p − q|   (tv)
        c_t     = where(low ≤ g_{u(t)} ≤ high, ρ_t, 0)

    with ``p = clamp(π_rollout, 1e-6, 1 − 1e-6)`` and ``q = clamp(π_numerator, 1e-6, 1 − 1e-6)`` of the
    sampled token. :class:`~packloss.RolloutCorrection` with ``mode="mask"`` weights a sequence by its
    own ratio; here the sequence gate keeps each token's ``ρ_t``. ``low=None``: no lower bound.
    Metrics as a masking RolloutCorrection: ``rollout_is_weight``, ``rollout_is_masked`` (members of
    dropped units).
    """

    level: Literal["token", "sequence"] = "sequence"
    mode: Literal["truncate", "mask"] = "mask"
    gating: Literal["ratio", "binary_kl", "tv"] = "ratio"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gating not in IS_GATINGS:
            raise ValueError(f"GatedCorrection.gating must be one of {IS_GATINGS}, got {self.gating!r}")
        if self.mode != "mask" or not self.weighted:
            raise ValueError("GatedCorrection drops the units outside the band: it needs mode='mask', weighted=True")

    def _streams(self, inputs, ratio: str) -> tuple[Tensor, Tensor]:
        """``(numerator, inf)`` log-probs ``[N]``, detached (the numerator as :meth:`log_ratio`'s)."""
        inf = getattr(inputs, "inference_logprobs", None)
        if inf is None:
            raise ValueError("a GatedCorrection needs inference_logprobs, got None")
        old = getattr(inputs, "old_logprobs", None)
        num = old if (ratio == "old" and old is not None) else inputs.trainer_logprobs
        return upcast(num.detach()), upcast(inf.detach())

    def statistic(self, num: Tensor, inf: Tensor, m: Tensor, seq_ids: Tensor, num_seqs: int) -> Tensor:
        """The gated statistic: ``[N]`` per token (``level="token"``) or ``[S]`` per sequence."""
        if self.gating == "ratio":
            log_rho = torch.where(m, num - inf, 0.0)  # [N]
            if self.level == "sequence":
                return torch.exp(segment_mean(log_rho, m, seq_ids, num_seqs)[0])  # [S]
            return torch.exp(log_rho)
        p = torch.exp(torch.where(m, inf, 0.0)).clamp(_PROB_CLAMP, 1 - _PROB_CLAMP)  # [N], π_rollout
        q = torch.exp(torch.where(m, num, 0.0)).clamp(_PROB_CLAMP, 1 - _PROB_CLAMP)  # [N], π_old
        if self.gating == "binary_kl":
            divergence = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
        else:
            divergence = (p - q).abs()
        if self.level == "sequence":
            return segment_mean(divergence, m, seq_ids, num_seqs)[0]  # [S]
        return divergence

    def keep(self, stat: Tensor) -> Tensor:
        """``low ≤ stat ≤ high`` (NaN is never kept), same shape as ``stat``."""
        kept = stat <= self.high
        return kept if self.low is None else kept & (stat >= self.low)

    def weights(
        self, inputs, ratio: str, m: Tensor, seq_ids: Tensor, num_seqs: int
    ) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]]:
        """``(c [N], metrics)``: ``ρ_t`` on the members of kept units, 0 elsewhere (detached)."""
        num, inf = self._streams(inputs, ratio)
        kept = self.keep(self.statistic(num, inf, m, seq_ids, num_seqs))  # [N] or [S]
        if self.level == "sequence":
            kept = broadcast(kept, seq_ids)  # [N]
        rho = torch.exp(torch.where(m, num - inf, 0.0))  # [N]
        c = torch.where(m & kept, rho, 0.0)
        return c, {"rollout_is_weight": (c, m), "rollout_is_masked": (~kept, m)}


# ---------------------------------------------------------------------------------------------------
# OpenRLHF's settings → a PolicyGradient
# ---------------------------------------------------------------------------------------------------


def _number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"PolicyLoss.{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"PolicyLoss.{name} must be finite, got {value}")
    return float(value)


def _choice(value: object, name: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"PolicyLoss.{name} must be one of {allowed}, got {value!r}")
    return value


def _threshold(threshold: object) -> tuple[float, float]:
    if isinstance(threshold, str | bytes) or not isinstance(threshold, Sequence) or len(threshold) != 2:
        raise ValueError(f"PolicyLoss.is_correction_threshold must be (low, high), got {threshold!r}")
    low, high = (_number(v, "is_correction_threshold") for v in threshold)
    if not low < high:
        raise ValueError(f"PolicyLoss.is_correction_threshold must have low < high, got {tuple(threshold)}")
    if not high > 0:
        raise ValueError(f"PolicyLoss.is_correction_threshold high must be > 0, got {high}")
    return low, high


def _correction(level: str, mode: str, gating: str, threshold: tuple[float, float]) -> RolloutCorrection:
    """The correction of OpenRLHF's ``is_correction_*`` (``level != "off"``, ``policy_loss_type="ppo"``)."""
    low, high = threshold
    # ρ and the divergences are ≥ 0 (ρ > 0): a lower bound ≤ 0 never binds
    low_or_none = low if low > 0 else None
    packed_level = "sequence" if level == "seq" else "token"
    if gating == "ratio" and level == "token":
        return RolloutCorrection("token", "truncate" if mode == "clip" else "mask", high, low_or_none)
    return GatedCorrection(level=packed_level, mode="mask", high=high, low=low_or_none, gating=gating)


def policy_gradient(
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip: float | None = None,
    policy_loss_type: str = "ppo",
    is_correction_level: str = "off",
    is_correction_mode: str = "mask",
    is_correction_gating: str = "ratio",
    is_correction_threshold: Sequence[float] = (0.5, 5.0),
) -> PolicyGradient:
    """The :class:`~packloss.PolicyGradient` of OpenRLHF's ``PolicyLoss`` settings (module table).

    Validates as OpenRLHF's constructor does (``ValueError`` naming the argument; a ``dual_clip`` that
    OpenRLHF asserts ``> 1`` is a ``ValueError`` here), and ``clip_eps_low`` in ``[0, 1)``,
    ``clip_eps_high ≥ 0``, a threshold ``low < high`` with ``high > 0`` (OpenRLHF accepts an empty band).
    """
    _choice(policy_loss_type, "policy_loss_type", POLICY_LOSS_TYPES)
    level = _choice(is_correction_level, "is_correction_level", IS_LEVELS)
    mode = _choice(is_correction_mode, "is_correction_mode", IS_MODES)
    gating = _choice(is_correction_gating, "is_correction_gating", IS_GATINGS)
    low, high = _number(clip_eps_low, "clip_eps_low"), _number(clip_eps_high, "clip_eps_high")
    if not 0 <= low < 1:
        raise ValueError(f"PolicyLoss.clip_eps_low must be in [0, 1), got {low}")
    if not high >= 0:
        raise ValueError(f"PolicyLoss.clip_eps_high must be >= 0, got {high}")
    if dual_clip is not None and not _number(dual_clip, "dual_clip") > 1:
        raise ValueError(f"PolicyLoss.dual_clip must be > 1.0, got {dual_clip}")
    if mode == "clip" and (level == "seq" or gating != "ratio"):
        raise ValueError("PolicyLoss: is_correction_mode=clip requires is_correction_level=token and gating=ratio")
    threshold = (0.5, 5.0)
    if level != "off":
        threshold = _threshold(is_correction_threshold)
        if gating != "ratio" and threshold[0] > 0:
            raise ValueError(
                f"PolicyLoss.is_correction_gating={gating!r} takes an upper bound only: is_correction_threshold "
                f"low must be <= 0, got {threshold[0]}"
            )
    dual = None if dual_clip is None else float(dual_clip)
    if policy_loss_type == "gspo":
        # OpenRLHF's gspo measures its ratio against π_rollout when a correction is on, and applies none
        return PolicyGradient(SequenceRatioClip(low, high, dual), ratio="rollout" if level != "off" else "old")
    correction = None if level == "off" else _correction(level, mode, gating, threshold)
    return PolicyGradient(ClampedPPOClip(low, high, dual), ratio="old", correction=correction)


# ---------------------------------------------------------------------------------------------------
# The drop-in module
# ---------------------------------------------------------------------------------------------------


def _per_rank(value: float | Tensor, dp_size: int, name: str, dtype: torch.dtype, device: torch.device):
    """``value / dp_size``: OpenRLHF's ``Σ ℓ / value · dp_size`` as a constant denominator (a number, or
    a 0-d tensor in the compute dtype; a tensor's value is not read)."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise ValueError(f"PolicyLoss.forward {name} must be a number or a one-element real tensor")
        return value.detach().reshape(()).to(device=device, dtype=dtype) / dp_size
    number = _number(value, f"forward {name}")
    if not number > 0:
        raise ValueError(f"PolicyLoss.forward {name} must be > 0, got {value}")
    return number / dp_size


def aggregate_component(
    loss: ComponentLoss,
    members: Tensor,
    layout: PaddedLayout,
    token_level_loss: bool = True,
    dp_size: int = 1,
    batch_num_tokens: float | Tensor | None = None,
    global_batch_size: float | Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> Component:
    """OpenRLHF's ``aggregate_loss`` as the normalisation of a packloss :class:`~packloss.Component`.

    ``members [B, T]`` bool (the action mask), packed by ``layout``; ``dtype`` the compute dtype (of
    the weights and of a tensor constant). Per the module table::

        token-level:  Σ ℓ / n_members                    | Σ ℓ / batch_num_tokens · dp_size
        seq-level:    Σ_s (Σ_{t∈s} ℓ_t / n_s) / S_members | Σ_s (Σ_{t∈s} ℓ_t / n_s) / global_batch_size · dp_size

    OpenRLHF's actor reduces its KL and entropy terms with the same function: a component of this
    aggregation reproduces them too.
    """
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"PolicyLoss.forward dp_size must be an int >= 1, got {dp_size!r}")
    m = layout.pack(members, "action_mask")  # [N]
    if token_level_loss:
        if batch_num_tokens is None:
            return Component(loss, mask=m, normalize=Normalize.TOKEN)
        constant = _per_rank(batch_num_tokens, dp_size, "batch_num_tokens", dtype, m.device)
        return Component(loss, mask=m, normalize=Normalize.CONSTANT, constant=constant)
    if global_batch_size is None:
        return Component(loss, mask=m, normalize=Normalize.SEQUENCE_MEAN)
    # Σ_s (Σ_{t∈s} ℓ_t / n_s) / G · dp_size: each row's token mean through weights 1/n_s
    row_count = members.sum(dim=1, keepdim=True, dtype=dtype).clamp_min(1)  # [B, 1]
    weights = layout.pack(torch.where(members, 1 / row_count, 0.0), "weights")  # [N]
    constant = _per_rank(global_batch_size, dp_size, "global_batch_size", dtype, m.device)
    return Component(loss, mask=m, weights=weights, normalize=Normalize.CONSTANT, constant=constant)


def _check_stream(value: object, name: str, shape: tuple[int, int]) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"PolicyLoss.forward {name} must be a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) != shape:
        raise ValueError(f"PolicyLoss.forward {name} must have shape [B, T] = {list(shape)}, got {list(value.shape)}")
    if not value.is_floating_point():
        raise TypeError(f"PolicyLoss.forward {name} must be a floating-point tensor, got {value.dtype}")
    return value


def _members(action_mask: Tensor | None, like: Tensor) -> Tensor:
    """The ``[B, T]`` bool members (every position when ``action_mask`` is None, as OpenRLHF's means)."""
    if action_mask is None:
        return torch.ones(like.shape, dtype=torch.bool, device=like.device)
    if not isinstance(action_mask, Tensor):
        raise TypeError(f"PolicyLoss.forward action_mask must be a torch.Tensor or None, got {type(action_mask)}")
    if tuple(action_mask.shape) != tuple(like.shape):
        raise ValueError(
            f"PolicyLoss.forward action_mask must have shape [B, T] = {list(like.shape)}, got {list(action_mask.shape)}"
        )
    if action_mask.is_floating_point() or action_mask.is_complex():
        raise NotImplementedError(
            f"PolicyLoss.forward action_mask of dtype {action_mask.dtype}: OpenRLHF would weight tokens by a "
            "floating-point mask (and add 1e-8 to its row counts), which is not mapped; pass action_mask.bool()"
        )
    return action_mask != 0


def _layout(members: Tensor, packing: str) -> PaddedLayout:
    """The packed layout of the ``[B, T]`` batch: each row one sequence."""
    b, t = members.shape
    if packing == "rows":  # every position: seq_lens are host-known, no sync
        index = torch.arange(b * t, device=members.device)
        return PaddedLayout((t,) * b, index, (b, t))
    # a row without members keeps its first position (a non-member) so that it stays a sequence
    first = torch.arange(t, device=members.device) == 0  # [T]
    keep = members | (first & ~members.any(dim=1, keepdim=True))  # [B, T]
    return PaddedLayout.from_attention_mask(keep)


class PolicyLoss(nn.Module):
    """OpenRLHF 0.11.2's ``PolicyLoss`` computed by packloss (module doc: mapping and differences).

    Args (OpenRLHF's): ``clip_eps_low``, ``clip_eps_high``, ``dual_clip``, ``token_level_loss``,
    ``policy_loss_type`` (``"ppo"``, ``"gspo"``; ``"gspo"`` forces ``token_level_loss=False``),
    ``is_correction_level`` (``"off"``, ``"token"``, ``"seq"``), ``is_correction_mode`` (``"mask"``,
    ``"clip"``), ``is_correction_gating`` (``"ratio"``, ``"binary_kl"``, ``"tv"``),
    ``is_correction_threshold`` (``(low, high)``).
    packing: ``"members"`` (default; one device→host sync per call) or ``"rows"`` (no sync).

    The settings are read once: ``objective`` is the :class:`~packloss.PolicyGradient` they map to.
    """

    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip: float | None = None,
        token_level_loss: bool = True,
        policy_loss_type: str = "ppo",
        is_correction_level: str = "off",
        is_correction_mode: str = "mask",
        is_correction_gating: str = "ratio",
        is_correction_threshold: Sequence[float] = (0.5, 5.0),
        *,
        packing: Literal["members", "rows"] = "members",
    ) -> None:
        super().__init__()
        if not isinstance(token_level_loss, bool):
            raise TypeError(f"PolicyLoss.token_level_loss must be a bool, got {type(token_level_loss).__name__}")
        self.objective = policy_gradient(
            clip_eps_low,
            clip_eps_high,
            dual_clip,
            policy_loss_type,
            is_correction_level,
            is_correction_mode,
            is_correction_gating,
            is_correction_threshold,
        )
        self.packing = _choice(packing, "packing", PACKINGS)
        self.clip_eps_low = clip_eps_low
        self.clip_eps_high = clip_eps_high
        self.dual_clip = dual_clip
        # GSPO's loss is per sequence (OpenRLHF overrides the flag the same way)
        self.token_level_loss = token_level_loss and policy_loss_type != "gspo"
        self.policy_loss_type = policy_loss_type
        self.is_correction_level = is_correction_level
        self.is_correction_mode = is_correction_mode
        self.is_correction_gating = is_correction_gating
        self.is_correction_threshold = is_correction_threshold

    @property
    def _needs_rollout(self) -> bool:
        return self.is_correction_level != "off"

    def forward(
        self,
        log_probs: Tensor,
        old_log_probs: Tensor,
        advantages: Tensor,
        action_mask: Tensor | None = None,
        rollout_log_probs: Tensor | None = None,
        dp_size: int = 1,
        batch_num_tokens: float | Tensor | None = None,
        global_batch_size: float | Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
        """``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)`` as OpenRLHF's ``forward``.

        Shapes ``[B, T]``; ``dp_size``, ``batch_num_tokens`` (token-level) and ``global_batch_size``
        (seq-level) as OpenRLHF's actor passes them: the loss is ``Σ ℓ / count · dp_size``.
        ``vllm_kl`` (mean ``log π_rollout − log π_old``) and ``is_filter_ratio`` are None unless a
        ``ppo`` correction is on.
        """
        if not isinstance(log_probs, Tensor) or log_probs.dim() != 2:
            shape = list(log_probs.shape) if isinstance(log_probs, Tensor) else type(log_probs).__name__
            raise ValueError(f"PolicyLoss.forward log_probs must be a [B, T] tensor, got {shape}")
        shape = tuple(log_probs.shape)
        if shape[0] < 1 or shape[1] < 1:
            raise ValueError(f"PolicyLoss.forward log_probs must have B >= 1 and T >= 1, got {list(shape)}")
        _check_stream(log_probs, "log_probs", shape)
        _check_stream(old_log_probs, "old_log_probs", shape)
        _check_stream(advantages, "advantages", shape)
        if rollout_log_probs is not None:
            _check_stream(rollout_log_probs, "rollout_log_probs", shape)
        elif self._needs_rollout:
            level = self.is_correction_level
            raise ValueError(f"PolicyLoss.forward rollout_log_probs is required with is_correction_level={level!r}")
        members = _members(action_mask, log_probs)  # [B, T]
        layout = _layout(members, self.packing)
        m = layout.pack(members, "action_mask")  # [N]
        lp = layout.pack(log_probs, "log_probs")  # [N], the gradient flows back to [B, T]
        old = layout.pack(old_log_probs.detach(), "old_log_probs")
        inf = None
        if self._needs_rollout:
            inf = layout.pack(rollout_log_probs.detach(), "rollout_log_probs")
        dtype = torch.promote_types(lp.dtype, torch.float32)  # the engine's compute dtype
        component = aggregate_component(
            self.objective, members, layout, self.token_level_loss, dp_size, batch_num_tokens, global_batch_size, dtype
        )
        plan = Plan(
            layout.seq_lens,
            {_COMPONENT: component},
            inference_logprobs=inf,
            old_logprobs=old,
            advantages=layout.pack(advantages.detach(), "advantages"),
        )
        result = compute_loss(plan, Outputs(logprobs=lp))

        count = m.sum(dtype=dtype).clamp_min(1)
        old_c = upcast(old)
        ppo_kl = torch.where(m, old_c - upcast(lp.detach()), 0.0).sum() / count
        clip_ratio = result.metrics[f"{_COMPONENT}/clip_ratio"]
        vllm_kl = is_filter_ratio = None
        correction = self.objective.correction
        if correction is not None:
            vllm_kl = torch.where(m, upcast(inf) - old_c, 0.0).sum() / count
            is_filter_ratio = self._filter_ratio(correction, result.metrics, old_c, upcast(inf), m, plan)
        return result.loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio

    def _filter_ratio(
        self,
        correction: RolloutCorrection,
        metrics: dict[str, Tensor],
        old: Tensor,
        inf: Tensor,
        m: Tensor,
        plan: Plan,
    ) -> Tensor:
        """OpenRLHF's ``is_filter_ratio``: dropped (or clamped) members over the members per token; per
        sequence, dropped rows over all ``B`` rows, a row without members counting as dropped."""
        if isinstance(correction, GatedCorrection) and correction.level == "sequence":
            seq_ids, num_seqs = plan.layout.seq_ids, plan.num_seqs
            kept = correction.keep(correction.statistic(old, inf, m, seq_ids, num_seqs))  # [S]
            has_members = segment_count(m, seq_ids, num_seqs) > 0  # [S]
            return (~(kept & has_members)).sum(dtype=torch.float32) / num_seqs
        key = "rollout_is_truncated" if correction.mode == "truncate" else "rollout_is_masked"
        return metrics[f"{_COMPONENT}/{key}"]
