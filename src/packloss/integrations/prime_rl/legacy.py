"""prime-rl's trainer loss module before PR #2951 (``prime_rl.trainer.rl.loss``), on packloss; the
README's one-import switch is ``from packloss.compat.prime_rl import ...``. Configs are matched by
their fields (``import_path`` → custom, ``ipo_threshold`` → IPO, ``dppo_mask_low``/``_high`` → DPPO),
so prime-rl's own pydantic configs work. Differences a caller sees: ``docs/integrations/prime_rl.md``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from packloss.core.kl import KLPenalty
from packloss.core.pg import PolicyGradient
from packloss.core.trust_regions import DPPOMask, IPOMask
from packloss.integrations.common.config import ConfigReader
from packloss.integrations.prime_rl.loss import *  # noqa: F403  # prime-rl's shared names, re-exported
from packloss.integrations.prime_rl.loss import SHARED, LossFn, LossInputs, LossOutputs, import_object, summed

__all__ = [*SHARED, "DefaultLossConfig", "IPOLossConfig", "CustomLossConfig", "LossConfig", "setup_rl_loss_fn",
           "default_loss_fn", "ipo_loss_fn"]  # fmt: skip


@dataclass(frozen=True)
class DefaultLossConfig:
    """prime-rl's default (DPPO + KL) loss settings."""

    dppo_mask_low: float = 0.2
    dppo_mask_high: float = 0.2
    adv_tau: float = 1.0
    kl_tau: float = 1e-3


@dataclass(frozen=True)
class IPOLossConfig:
    """prime-rl's IPO loss settings."""

    ipo_threshold: float = 0.1
    adv_tau: float = 1.0
    kl_tau: float = 1e-3


@dataclass(frozen=True)
class CustomLossConfig:
    """A custom rl loss: ``import_path`` (``"pkg.module.function"`` or ``"pkg.module:function"``)
    called as ``function(inputs, **kwargs)``."""

    import_path: str
    kwargs: dict[str, Any] = field(default_factory=dict)


LossConfig = DefaultLossConfig | IPOLossConfig | CustomLossConfig


def _objective(loss_config: Any) -> PolicyGradient:
    """The objective of a DPPO- or IPO-shaped config (matched by its fields), validated in the
    config's own option names."""
    is_ipo = hasattr(loss_config, "ipo_threshold")
    c = ConfigReader(loss_config, "IPOLossConfig" if is_ipo else "DefaultLossConfig")
    if is_ipo:
        region = IPOMask(c.nonnegative("ipo_threshold"))
    else:
        region = DPPOMask(c.nonnegative("dppo_mask_low"), c.nonnegative("dppo_mask_high"))
    drift = KLPenalty(c.nonnegative("kl_tau"), "squared_log_ratio", "rollout")
    return PolicyGradient(region, ratio="rollout", adv_coef=c.number("adv_tau"), penalties=(drift,))


def default_loss_fn(inputs: LossInputs, loss_config: DefaultLossConfig) -> LossOutputs:
    """DPPO trust region + squared-log-ratio drift KL (:data:`packloss.DPPO`)."""
    return summed(inputs, _objective(loss_config))


def ipo_loss_fn(inputs: LossInputs, loss_config: IPOLossConfig) -> LossOutputs:
    """IPO: symmetric trust region ``|dp| > ipo_threshold`` (:data:`packloss.IPO`)."""
    return summed(inputs, _objective(loss_config))


def setup_rl_loss_fn(loss_config: Any) -> LossFn:
    """The rl loss function for a prime-rl loss config, matched by its fields."""
    if hasattr(loss_config, "import_path"):
        custom_fn = import_object(loss_config.import_path)
        if not callable(custom_fn):
            raise TypeError(f"CustomLossConfig.import_path must name a function, got {type(custom_fn).__name__}")
        kwargs = dict(getattr(loss_config, "kwargs", None) or {})
        return lambda inputs: custom_fn(inputs, **kwargs)
    if hasattr(loss_config, "ipo_threshold") or hasattr(loss_config, "dppo_mask_low"):
        objective = _objective(loss_config)
        return lambda inputs: summed(inputs, objective)
    raise TypeError(
        "loss_config must look like DefaultLossConfig (dppo_mask_low/high), IPOLossConfig (ipo_threshold) or "
        f"CustomLossConfig (import_path), got {type(loss_config).__name__}"
    )
