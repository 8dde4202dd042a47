"""prime-rl's current trainer loss API (after #3418, #3526 and #3586) on packloss: ``[trainer.loss]``
configs discriminated by ``type`` (``"ipo"``, the default; ``"icepop"``; ``"custom"``), loss objects
with one method ``loss(inputs) -> LossOutputs`` built by :func:`setup_rl_loss_fn`, and prime-rl's
``compute_loss``. Configs are read by their fields, never their class, so prime-rl's pydantic configs
work; a field this module does not implement is a ``ValueError`` naming it. The formulas and the
differences from prime-rl's code: ``docs/integrations/prime_rl.md``."""

from __future__ import annotations

import functools
import inspect
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal, Protocol

from torch import Tensor

from packloss.core.kl import KLPenalty
from packloss.core.pg import PolicyGradient
from packloss.core.trust_regions import IcePopLogBand, IPOMask
from packloss.integrations.common.config import ConfigReader
from packloss.integrations.prime_rl import loss as _loss
from packloss.integrations.prime_rl.loss import *  # noqa: F403  # prime-rl's shared names, re-exported
from packloss.integrations.prime_rl.loss import SHARED, LossFn, LossInputs, LossOutputs, import_object, summed

__all__ = [*SHARED, "Loss", "IPOLossConfig", "IcePopLossConfig", "CustomLossConfig", "LossConfig", "IPOLoss",
           "IcePopLoss", "CustomLoss", "setup_rl_loss_fn"]  # fmt: skip

METRICS = ("masked_mismatch_kl", "unmasked_mismatch_kl", "is_masked")
"""The rl metrics prime-rl's IPO and IcePop losses report."""


class Loss(Protocol):
    """prime-rl's rl loss interface: an object built from its config with one method."""

    def loss(self, inputs: LossInputs) -> LossOutputs: ...


@dataclass(frozen=True)
class IPOLossConfig:
    """``[trainer.loss] type = "ipo"`` (prime-rl's default): drop members whose probability moved by
    more than ``eps``; ``adv_tau`` scales the advantage, ``kl_tau`` the squared log-ratio term."""

    eps: float = 0.3
    adv_tau: float = 1.0
    kl_tau: float = 0.0
    type: Literal["ipo"] = field(default="ipo", kw_only=True)

    def __post_init__(self) -> None:
        _ipo_params(self)


@dataclass(frozen=True)
class IcePopLossConfig:
    """``[trainer.loss] type = "icepop"``: keep members whose ratio lies in ``[ratio_low, ratio_high]``."""

    ratio_low: float = 0.2
    ratio_high: float = 5.0
    adv_tau: float = 1.0
    type: Literal["icepop"] = field(default="icepop", kw_only=True)

    def __post_init__(self) -> None:
        _icepop_params(self)


@dataclass(frozen=True)
class CustomLossConfig:
    """``[trainer.loss] type = "custom"``: ``import_path`` (``"pkg.module.function"`` or
    ``"pkg.module:function"``) called as ``function(inputs, **kwargs)``."""

    import_path: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    type: Literal["custom"] = field(default="custom", kw_only=True)

    def __post_init__(self) -> None:
        _reader(self, "custom")
        if not isinstance(self.import_path, str):
            raise TypeError(f"CustomLossConfig.import_path must be a str, got {type(self.import_path).__name__}")


LossConfig = IPOLossConfig | IcePopLossConfig | CustomLossConfig


def _defaults(cls: type) -> dict[str, Any]:
    """The fields of config class ``cls`` that have a default, with it."""
    has = [f for f in fields(cls) if f.default is not MISSING or f.default_factory is not MISSING]
    return {f.name: f.default if f.default_factory is MISSING else f.default_factory() for f in has}


_CONFIGS = {"ipo": IPOLossConfig, "icepop": IcePopLossConfig, "custom": CustomLossConfig}
_CLASS = {kind: cls.__name__ for kind, cls in _CONFIGS.items()}
_FIELDS = {kind: {f.name for f in fields(cls)} for kind, cls in _CONFIGS.items()}
_DEFAULTS = {kind: _defaults(cls) for kind, cls in _CONFIGS.items()}
_WHY = {
    "ipo_threshold": "the #2951-era name of eps (prime-rl #3418 renamed it); that API is packloss.compat.prime_rl",
    "max_importance_ratio": "a later prime-rl IPO option (a capped importance weight) this adapter does not implement",
    "score_centering": "a later prime-rl IPO option this adapter does not implement",
}


def _reader(config: Any, kind: str) -> ConfigReader:
    """A reader of a ``kind`` config; a field prime-rl's current ``kind`` loss does not have is a
    ``ValueError`` naming it (a loss computed differently from what the config's author meant)."""
    c = ConfigReader(config, _CLASS[kind], _DEFAULTS[kind])
    if c.get("type") != kind:
        raise ValueError(f"{_CLASS[kind]}.type must be {kind!r}, got {c.get('type')!r}")
    declared = c.declared()
    unknown = sorted(declared - _FIELDS[kind]) if declared is not None else []
    if unknown:
        why = "; ".join(f"{name}: {_WHY[name]}" for name in unknown if name in _WHY)
        raise ValueError(
            f"{_CLASS[kind]} has fields {unknown} that prime-rl's current {kind!r} loss does not have"
            + (f" ({why})" if why else "")
            + f"; expected a subset of {sorted(_FIELDS[kind])}"
        )
    return c


def _ipo_params(config: Any) -> tuple[float, float, float]:
    """``(eps, adv_tau, kl_tau)`` of an IPO-shaped config, validated."""
    c = _reader(config, "ipo")
    return c.nonnegative("eps"), c.nonnegative("adv_tau"), c.nonnegative("kl_tau")


def _icepop_params(config: Any) -> tuple[float, float, float]:
    """``(ratio_low, ratio_high, adv_tau)`` of an IcePop-shaped config, validated."""
    c = _reader(config, "icepop")
    low, high = c.positive("ratio_low"), c.positive("ratio_high")
    if low > high:
        raise ValueError(f"IcePopLossConfig.ratio_low must not exceed ratio_high, got {low} > {high}")
    return low, high, c.nonnegative("adv_tau")


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


class _ObjectiveLoss:
    """A loss object around one :class:`~packloss.PolicyGradient` built from its config."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.objective = self.build(config)

    @staticmethod
    def build(config: Any) -> PolicyGradient:
        raise NotImplementedError

    def loss(self, inputs: LossInputs) -> LossOutputs:
        return summed(_as_inputs(inputs), self.objective, METRICS)


class IPOLoss(_ObjectiveLoss):
    """prime-rl's IPO loss: ``keep = |exp(trn) − exp(inf)| ≤ eps``,
    ``ℓ = −keep · (adv_tau · A) · r + kl_tau · (trn − inf)²`` (:class:`~packloss.core.trust_regions.IPOMask`)."""

    @staticmethod
    def build(config: Any) -> PolicyGradient:
        eps, adv_tau, kl_tau = _ipo_params(config)
        drift = (KLPenalty(kl_tau, "squared_log_ratio", "rollout"),) if kl_tau > 0 else ()
        return PolicyGradient(IPOMask(eps), ratio="rollout", adv_coef=adv_tau, penalties=drift)


class IcePopLoss(_ObjectiveLoss):
    """prime-rl's IcePop loss: ``keep = log(ratio_low) ≤ trn − inf ≤ log(ratio_high)``,
    ``ℓ = −keep · adv_tau · A · exp(where(keep, trn − inf, 0))``
    (:class:`~packloss.core.trust_regions.IcePopLogBand`). No KL term."""

    @staticmethod
    def build(config: Any) -> PolicyGradient:
        low, high, adv_tau = _icepop_params(config)
        return PolicyGradient(IcePopLogBand(low, high), ratio="rollout", adv_coef=adv_tau)


class CustomLoss:
    """prime-rl's custom loss: the function at ``config.import_path``, imported once, called as
    ``function(inputs, **config.kwargs)`` on the whole bin."""

    def __init__(self, config: Any) -> None:
        c = _reader(config, "custom")
        self.config = config
        self.fn: LossFn = import_object(c.get("import_path"))
        if not callable(self.fn):
            raise TypeError(f"CustomLossConfig.import_path must name a function, got {type(self.fn).__name__}")
        kwargs = c.get("kwargs") or {}
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
    if kind == "default":
        raise ValueError(
            "loss_config.type 'default' (DPPO) was removed from prime-rl in #3418; "
            "the #2951-era API with DPPO is packloss.compat.prime_rl"
        )
    builders = {"ipo": IPOLoss, "icepop": IcePopLoss, "custom": CustomLoss}
    if kind not in builders:
        raise ValueError(f"loss_config.type must be one of {sorted(builders)}, got {kind!r}")
    return builders[kind](loss_config)


@functools.wraps(_loss.compute_loss)
def compute_loss(*args: Any, **kwargs: Any) -> tuple[Tensor, dict[str, Tensor]]:
    bound = _SIGNATURE.bind(*args, **kwargs)
    method = getattr(bound.arguments["rl_loss_fn"], "loss", None)
    if not callable(method):
        raise TypeError(
            "rl_loss_fn must be a Loss (an object with a .loss(inputs) method, as setup_rl_loss_fn builds), "
            f"got {type(bound.arguments['rl_loss_fn']).__name__}; a plain loss function is the #2951-era API "
            "(packloss.compat.prime_rl)"
        )
    bound.arguments["rl_loss_fn"] = method
    return _loss.compute_loss(*bound.args, **bound.kwargs)


compute_loss.__doc__ = """prime-rl's ``compute_loss`` (:func:`packloss.integrations.prime_rl.loss.compute_loss`'s
signature) with ``rl_loss_fn.loss`` as the rl loss, called once per bin."""
_SIGNATURE = inspect.signature(_loss.compute_loss)
