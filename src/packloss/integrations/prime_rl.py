"""prime-rl's current trainer loss API (after #3418, #3526 and #3586), on packloss's packed engine.

Switch by changing the imports::

    # from prime_rl.configs.trainer import IPOLossConfig, IcePopLossConfig, CustomLossConfig
    # from prime_rl.trainer.rl.loss import LossInputs, LossOutputs, compute_loss, setup_rl_loss_fn
    from packloss.integrations.prime_rl import (
        IPOLossConfig, IcePopLossConfig, CustomLossConfig, LossInputs, LossOutputs, compute_loss, setup_rl_loss_fn,
    )

    rl_loss = setup_rl_loss_fn(config.trainer.loss)          # prime-rl's own pydantic config works
    loss, metrics = compute_loss(..., rl_loss_fn=rl_loss, rl_scale=..., ce_scale=..., ref_kl_scale=...)

What prime-rl defines, and this module mirrors:

* ``[trainer.loss]`` configs discriminated by ``type``: ``"ipo"`` (the default; ``eps = 0.3``,
  ``adv_tau = 1``, ``kl_tau = 0``), ``"icepop"`` (``ratio_low = 0.2``, ``ratio_high = 5``,
  ``adv_tau = 1``) and ``"custom"`` (``import_path``, ``kwargs``). ``"default"`` (DPPO) is gone (#3418).
* ``setup_rl_loss_fn(config)`` builds a loss *object* satisfying the :class:`Loss` protocol, one method
  ``loss(inputs: LossInputs) -> LossOutputs`` and no ``__call__``: :class:`IPOLoss`,
  :class:`IcePopLoss` or :class:`CustomLoss`. Here the dispatch reads ``config.type`` and the fields
  by name (duck typing), never the class, so prime-rl's pydantic configs, the dataclasses below and
  any object with those fields all work. A field this module does not implement (``ipo_threshold``
  of the #2951-era config, the later ``max_importance_ratio`` / ``score_centering``) is a
  ``ValueError`` naming it, not a silently different loss.
* ``compute_loss`` keeps prime-rl's signature and calls ``rl_loss_fn.loss``; ce and ref_kl are
  prime-rl's fixed components, unchanged since the #2951 era.

Per member token ``t`` of the rl component, ``r = exp(trn − inf)``, ``A`` the advantage, ``w`` the
rl weight (1 when absent); the loss is ``Σ_t ℓ_t · w_t`` and ``compute_loss`` divides it by ``rl_scale``:

* IPO: ``keep = |exp(trn) − exp(inf)| ≤ eps``; ``ℓ = −keep · (adv_tau · A) · r + kl_tau · (trn − inf)²``.
  This is :class:`~packloss.core.trust_regions.IPOMask` with ``threshold = eps`` (the #2951-era
  ``ipo_threshold`` renamed) and a squared-log-ratio :class:`~packloss.core.pg.KLPenalty` against
  π_rollout, left out when ``kl_tau = 0``.
* IcePop: ``keep = log(ratio_low) ≤ trn − inf ≤ log(ratio_high)``, both bounds included and
  compared in log space, with the bounds' logs taken in the stream's dtype;
  ``ℓ = −keep · adv_tau · A · exp(where(keep, trn − inf, 0))``: the ratio of a dropped token is
  replaced before ``exp``, so an overflowing ratio never turns into ``0 · inf = NaN`` in the loss or
  gradient. No KL term. :class:`IcePopLogBand` (this module's trust region): packloss's
  :class:`~packloss.core.trust_regions.IcePop` compares ``exp(log r)`` with the bounds (it drops a
  float32 ratio of exactly 0.2, prime-rl keeps it), needs ``low < high`` and is not NaN-safe for a
  dropped member whose ratio overflows.

Metrics, as prime-rl names them: ``is_masked`` (dropped members), ``masked_mismatch_kl`` /
``unmasked_mismatch_kl`` (``r − log r − 1`` over the dropped / kept members). Like the #2951-era
compat module (:mod:`packloss.compat.prime_rl`), each is one token-weighted value per micro-batch
(prime-rl: one per sequence, stacked), and losses, custom ones included, are called once per bin
with the concatenated streams and the layout fields of :class:`LossInputs`.

Known differences from prime-rl's code, each in a corner:

* prime-rl's IcePop multiplies the bool mask by ``adv_tau`` first, which rounds ``adv_tau`` to
  float32 even for float64 streams; here ``adv_tau · A`` is taken in the streams' dtype (equal for
  float32 streams and for ``adv_tau`` exact in float32, e.g. 1).
* bf16/fp16 streams are computed in float32 here (prime-rl: in their own dtype).
* ``masked_mismatch_kl`` is ``inf`` when a dropped member's ratio overflows, as in prime-rl up to
  #3586 (later prime-rl clamps it at 1e30).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from packloss.compat.prime_rl import (
    LossFn,
    LossInputs,
    LossOutputs,
    ce_loss_fn,
    compute_entropy,
    import_object,
    ref_kl_loss_fn,
    selective_log_softmax,
    shift_tensor_left,
    shift_tensor_right,
)
from packloss.compat.prime_rl import compute_loss as _compat_compute_loss
from packloss.core.bin import upcast
from packloss.core.pg import KLPenalty, PolicyGradient, pg_loss
from packloss.core.trust_regions import IPOMask, PolicyTerms, Surrogate, TrustRegion

__all__ = [
    "Loss",
    "LossFn",
    "LossInputs",
    "LossOutputs",
    "IPOLossConfig",
    "IcePopLossConfig",
    "CustomLossConfig",
    "LossConfig",
    "IPOLoss",
    "IcePopLoss",
    "CustomLoss",
    "IcePopLogBand",
    "setup_rl_loss_fn",
    "compute_loss",
    "ce_loss_fn",
    "ref_kl_loss_fn",
    "selective_log_softmax",
    "compute_entropy",
    "shift_tensor_left",
    "shift_tensor_right",
]

METRICS = ("masked_mismatch_kl", "unmasked_mismatch_kl", "is_masked")
"""The rl metrics prime-rl's IPO and IcePop losses report."""


class Loss(Protocol):
    """prime-rl's rl loss interface: an object built from its config with one method."""

    def loss(self, inputs: LossInputs) -> LossOutputs: ...


# ---------------------------------------------------------------------------------------------------
# Configs (prime-rl's field names, types and defaults; frozen dataclasses instead of pydantic)
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IPOLossConfig:
    """``[trainer.loss] type = "ipo"`` (prime-rl's default): drop members whose probability moved
    by more than ``eps``; ``adv_tau`` scales the advantage, ``kl_tau`` the squared log-ratio term."""

    eps: float = 0.3
    adv_tau: float = 1.0
    kl_tau: float = 0.0
    type: Literal["ipo"] = field(default="ipo", kw_only=True)

    def __post_init__(self) -> None:
        _check_type(self, "ipo")
        _ipo_params(self)


@dataclass(frozen=True)
class IcePopLossConfig:
    """``[trainer.loss] type = "icepop"``: keep members whose ratio lies in ``[ratio_low, ratio_high]``."""

    ratio_low: float = 0.2
    ratio_high: float = 5.0
    adv_tau: float = 1.0
    type: Literal["icepop"] = field(default="icepop", kw_only=True)

    def __post_init__(self) -> None:
        _check_type(self, "icepop")
        _icepop_params(self)


@dataclass(frozen=True)
class CustomLossConfig:
    """``[trainer.loss] type = "custom"``: ``import_path`` (``"pkg.module.function"`` or
    ``"pkg.module:function"``) called as ``function(inputs, **kwargs)``."""

    import_path: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    type: Literal["custom"] = field(default="custom", kw_only=True)

    def __post_init__(self) -> None:
        _check_type(self, "custom")
        _check_fields(self, "custom")
        if not isinstance(self.import_path, str):
            raise TypeError(f"CustomLossConfig.import_path must be a str, got {type(self.import_path).__name__}")


LossConfig = IPOLossConfig | IcePopLossConfig | CustomLossConfig


# ---------------------------------------------------------------------------------------------------
# Reading a config by its fields
# ---------------------------------------------------------------------------------------------------

_CLASS = {"ipo": "IPOLossConfig", "icepop": "IcePopLossConfig", "custom": "CustomLossConfig"}
_FIELDS = {
    "ipo": {"type", "eps", "adv_tau", "kl_tau"},
    "icepop": {"type", "ratio_low", "ratio_high", "adv_tau"},
    "custom": {"type", "import_path", "kwargs"},
}
_WHY = {
    "ipo_threshold": "the #2951-era name of eps (prime-rl #3418 renamed it); that API is packloss.compat.prime_rl",
    "max_importance_ratio": "a later prime-rl IPO option (a capped importance weight) this adapter does not implement",
    "score_centering": "a later prime-rl IPO option this adapter does not implement",
}


def _declared_fields(config: Any) -> set[str] | None:
    """The field names an object declares (pydantic v2/v1 models, dataclasses, plain instances);
    None when it cannot tell (e.g. attributes defined on its class)."""
    cls = type(config)
    for attr in ("model_fields", "__fields__"):  # pydantic v2, v1: read on the class (v2.11 deprecates the instance)
        declared = getattr(cls, attr, None)
        if isinstance(declared, dict):
            return set(declared)
    if dataclasses.is_dataclass(config):
        return {f.name for f in dataclasses.fields(config)}
    return set(vars(config)) if hasattr(config, "__dict__") else None


def _check_fields(config: Any, kind: str) -> None:
    """Raise a ``ValueError`` naming the fields of ``config`` that ``kind`` does not have: a loss this
    module would compute differently from the config's author."""
    declared = _declared_fields(config)
    unknown = sorted(declared - _FIELDS[kind]) if declared is not None else []
    if unknown:
        why = "; ".join(f"{name}: {_WHY[name]}" for name in unknown if name in _WHY)
        raise ValueError(
            f"{_CLASS[kind]} has fields {unknown} that prime-rl's current {kind!r} loss does not have"
            + (f" ({why})" if why else "")
            + f"; expected a subset of {sorted(_FIELDS[kind])}"
        )


def _check_type(config: Any, kind: str) -> None:
    if config.type != kind:
        raise ValueError(f"{_CLASS[kind]}.type must be {kind!r}, got {config.type!r}")


def _number(config: Any, kind: str, name: str, default: float) -> float:
    """``config.<name>`` (``default``, prime-rl's, when absent) as a finite float."""
    value = getattr(config, name, default)
    owner = f"{_CLASS[kind]}.{name}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{owner} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{owner} must be finite, got {value}")
    return float(value)


def _nonnegative(kind: str, name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{_CLASS[kind]}.{name} must be >= 0, got {value}")


def _ipo_params(config: Any) -> tuple[float, float, float]:
    """``(eps, adv_tau, kl_tau)`` of an IPO-shaped config, validated."""
    _check_fields(config, "ipo")
    params = tuple(_number(config, "ipo", name, d) for name, d in (("eps", 0.3), ("adv_tau", 1.0), ("kl_tau", 0.0)))
    for name, value in zip(("eps", "adv_tau", "kl_tau"), params, strict=True):
        _nonnegative("ipo", name, value)
    return params


def _icepop_params(config: Any) -> tuple[float, float, float]:
    """``(ratio_low, ratio_high, adv_tau)`` of an IcePop-shaped config, validated."""
    _check_fields(config, "icepop")
    low = _number(config, "icepop", "ratio_low", 0.2)
    high = _number(config, "icepop", "ratio_high", 5.0)
    adv_tau = _number(config, "icepop", "adv_tau", 1.0)
    for name, value in (("ratio_low", low), ("ratio_high", high)):
        if not value > 0:
            raise ValueError(f"IcePopLossConfig.{name} must be > 0, got {value}")
    if low > high:
        raise ValueError(f"IcePopLossConfig.ratio_low must not exceed ratio_high, got {low} > {high}")
    _nonnegative("icepop", "adv_tau", adv_tau)
    return low, high, adv_tau


# ---------------------------------------------------------------------------------------------------
# The trust region of prime-rl's IcePop
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IcePopLogBand(TrustRegion):
    """prime-rl's IcePop band (#3526): keep a member iff ``log(ratio_low) ≤ log_r ≤ log(ratio_high)``::

        J_t = keep_t · a_t · exp(where(keep_t, log_r_t, 0))

    Both bounds included, compared in log space with the bounds' logs in ``log_r``'s dtype (so a
    ratio read back from ``log(0.2)`` sits on the bound); the ratio of a dropped token is replaced
    before ``exp`` (an overflowing one gives no NaN). Metric ``is_masked`` only. Not registered in
    :data:`~packloss.core.trust_regions.TRUST_REGIONS` (``docs/objectives.md`` is rendered from that
    registry); pass an instance to :class:`~packloss.core.pg.PolicyGradient`.
    """

    ratio_low: float = 0.2
    ratio_high: float = 5.0

    def check(self) -> None:
        super().check()
        if not 0 < self.ratio_low <= self.ratio_high:
            raise ValueError(
                f"IcePopLogBand needs 0 < ratio_low <= ratio_high, got {self.ratio_low}, {self.ratio_high}"
            )

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        log_r = t.log_r.detach()  # [N], 0 off the members
        # torch.full + log: the bound's log in log_r's dtype, as prime-rl takes it, without a host copy
        low = torch.full((), self.ratio_low, dtype=log_r.dtype, device=log_r.device).log()
        high = torch.full((), self.ratio_high, dtype=log_r.dtype, device=log_r.device).log()
        drop = (log_r < low) | (log_r > high)  # [N]
        keep = t.m & ~drop
        ratio = torch.exp(torch.where(keep, t.log_r, 0.0))  # masked before exp
        return Surrogate(torch.where(keep, t.a * ratio, 0.0), {"is_masked": drop})


# ---------------------------------------------------------------------------------------------------
# The loss objects
# ---------------------------------------------------------------------------------------------------


def _as_inputs(inputs: Any) -> LossInputs:
    """``inputs`` as a :class:`LossInputs` (a foreign object with prime-rl's fields becomes one
    sequence spanning its tokens)."""
    if isinstance(inputs, LossInputs):
        return inputs
    names = ("trainer_logprobs", "inference_logprobs", "ref_logprobs", "advantages", "loss_mask")
    missing = [name for name in names if not hasattr(inputs, name)]
    if missing:
        raise TypeError(
            f"inputs must be a LossInputs (prime-rl's fields), got {type(inputs).__name__} without {missing}"
        )
    return LossInputs(
        **{name: getattr(inputs, name) for name in names}, loss_weights=getattr(inputs, "loss_weights", None)
    )


def _summed(inputs: Any, objective: PolicyGradient) -> LossOutputs:
    """``Σ_t ℓ_t · w_t`` of ``objective`` over the members, in the per-token order of prime-rl's code,
    and prime-rl's metrics (with the member counts they were taken over)."""
    inputs = _as_inputs(inputs)
    out = pg_loss(inputs, objective)
    per_token = out.per_token  # [N], zero off the members
    if inputs.loss_weights is not None:
        per_token = per_token * torch.where(inputs.loss_mask, upcast(inputs.loss_weights), 0.0)
    return LossOutputs(
        loss=per_token.sum(),
        metrics={k: out.metrics[k] for k in METRICS},
        counts={k: out.counts[k] for k in METRICS},
    )


class IPOLoss:
    """prime-rl's IPO loss object (see the module doc for ``ℓ``)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        eps, adv_tau, kl_tau = _ipo_params(config)
        drift = (KLPenalty(kl_tau, "squared_log_ratio", "rollout"),) if kl_tau > 0 else ()
        self.objective = PolicyGradient(IPOMask(eps), ratio="rollout", adv_coef=adv_tau, penalties=drift)

    def loss(self, inputs: LossInputs) -> LossOutputs:
        return _summed(inputs, self.objective)


class IcePopLoss:
    """prime-rl's IcePop loss object (see the module doc for ``ℓ``)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        low, high, adv_tau = _icepop_params(config)
        self.objective = PolicyGradient(IcePopLogBand(low, high), ratio="rollout", adv_coef=adv_tau)

    def loss(self, inputs: LossInputs) -> LossOutputs:
        return _summed(inputs, self.objective)


class CustomLoss:
    """prime-rl's custom loss object: the function at ``config.import_path``, imported once, called
    as ``function(inputs, **config.kwargs)`` on the whole bin."""

    def __init__(self, config: Any) -> None:
        _check_fields(config, "custom")
        self.config = config
        self.fn: LossFn = import_object(config.import_path)
        if not callable(self.fn):
            raise TypeError(f"CustomLossConfig.import_path must name a function, got {type(self.fn).__name__}")
        kwargs = getattr(config, "kwargs", None) or {}
        if not isinstance(kwargs, dict):
            raise TypeError(f"CustomLossConfig.kwargs must be a dict, got {type(kwargs).__name__}")
        self.kwargs = dict(kwargs)

    def loss(self, inputs: LossInputs) -> LossOutputs:
        return self.fn(inputs, **self.kwargs)


def setup_rl_loss_fn(loss_config: Any) -> Loss:
    """The rl loss object of a ``[trainer.loss]`` config, chosen by its ``type`` field (never its class)."""
    kind = getattr(loss_config, "type", None)
    if not isinstance(kind, str):
        raise TypeError(
            "loss_config must be a prime-rl loss config with a str `type` field ('ipo', 'icepop' or 'custom'), "
            f"got {type(loss_config).__name__}"
        )
    match kind:
        case "ipo":
            return IPOLoss(loss_config)
        case "icepop":
            return IcePopLoss(loss_config)
        case "custom":
            return CustomLoss(loss_config)
        case "default":
            raise ValueError(
                "loss_config.type 'default' (DPPO) was removed from prime-rl in #3418; "
                "the #2951-era API with DPPO is packloss.compat.prime_rl"
            )
        case _:
            raise ValueError(f"loss_config.type must be one of {sorted(_CLASS)}, got {kind!r}")


def compute_loss(
    trainer_logprobs: list[Tensor],
    inference_logprobs: list[Tensor],
    ref_logprobs: list[Tensor] | None,
    advantages: list[Tensor],
    loss_mask: list[Tensor],
    rl_weights: list[Tensor] | None,
    ce_weights: list[Tensor] | None,
    ref_kl_weights: list[Tensor] | None,
    rl_loss_fn: Loss,
    rl_scale: int,
    ce_scale: int,
    ref_kl_scale: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """prime-rl's ``compute_loss``: lists of per-sequence ``[n_i]`` tensors in, ``(loss, metrics)`` out.

    ``loss = Σ rl / rl_scale + Σ ce / ce_scale + Σ ref_kl / ref_kl_scale``, with ``rl`` from
    ``rl_loss_fn.loss`` (called once on the concatenated bin); metrics are 1-element token-weighted
    tensors. Runs on :func:`packloss.compat.prime_rl.compute_loss` (no device→host sync).
    """
    method = getattr(rl_loss_fn, "loss", None)
    if not callable(method):
        raise TypeError(
            "rl_loss_fn must be a Loss (an object with a .loss(inputs) method, as setup_rl_loss_fn builds), "
            f"got {type(rl_loss_fn).__name__}; a plain loss function is the #2951-era API (packloss.compat.prime_rl)"
        )
    return _compat_compute_loss(
        trainer_logprobs,
        inference_logprobs,
        ref_logprobs,
        advantages,
        loss_mask,
        rl_weights,
        ce_weights,
        ref_kl_weights,
        method,
        rl_scale,
        ce_scale,
        ref_kl_scale,
    )
