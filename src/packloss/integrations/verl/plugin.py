"""packloss's objectives as verl 0.9.1 policy losses, registered in ``POLICY_LOSS_REGISTRY`` on ``import
verl`` (a ``verl.plugins`` entry point): ``actor_rollout_ref.actor.policy_loss.loss_mode=packloss_vanilla``.

One function per mapped verl loss mode (``packloss_<mode>``) plus ``packloss_topr`` and
``packloss_dppo``; :func:`register_objective` adds more. Each has verl's policy-loss signature, packs
the ``[B, T]`` rows as sequences (whole rows: no host read) and computes the loss with denominators
that are verl's ``agg_loss`` with ``config.global_batch_info``. Registration is idempotent and never
makes ``import verl`` fail. The normalisation table, metrics and differences: ``docs/integrations/verl.md``.
It also installs packloss's fused head as the fused-kernel backend ``impl_backend=packloss`` (:mod:`.head`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from packloss.core import checks
from packloss.core.bin import Component, Normalize, Plan
from packloss.core.engine import compute_loss
from packloss.core.kl import KLPenalty
from packloss.core.pg import PolicyGradient
from packloss.core.recipe import POLICY
from packloss.core.step import StepDenominators, count_denominators
from packloss.core.trust_regions import CISPO, DPPOKL, DPPOTV, GMPO, GSPO, SAPO, TOPR, ClipCov, DPPOMask, PPOClip
from packloss.integrations.common.config import ConfigReader
from packloss.integrations.common.metrics import RenameTable, component_metrics, peer_metrics
from packloss.integrations.common.padded import PaddedBatch, check_padded, log_ratio_mean
from packloss.integrations.verl.config import LOSS_AGG_MODES, LOSS_MODES, clip_range, from_verl
from packloss.integrations.verl.head import install as install_head

__all__ = ["PREFIX", "REGISTERED", "register", "register_objective", "policy_loss", "packloss_policy_loss",
           "rollout_corr_metrics"]  # fmt: skip

logger = logging.getLogger(__name__)

PREFIX = "packloss_"
"""The prefix of every policy loss this module registers in verl."""

_SEQUENCE_MEAN_AGG = "seq-mean-token-mean"  # what sapo aggregates by, whatever loss_agg_mode says
_ROWS = "rows"  # geo_mean: the mean over the call's rows
_OWN_AGGREGATION = {"sapo": _SEQUENCE_MEAN_AGG, "geo_mean": _ROWS}
_IS_LOG_EPS = 1e-10  # verl's log(w + 1e-10) in geo_mean's geometric mean of the weights
_DPPO_DRIFT = 1e-3  # prime-rl's kl_tau

CLIP_FRACTIONS: dict[type, RenameTable] = {
    PPOClip: {"actor/pg_clipfrac": ("clip_frac_low", "clip_frac_high"), "actor/pg_clipfrac_lower": ("dual_clip_frac",)},
    GSPO: {"actor/pg_clipfrac": ("clip_frac_low", "clip_frac_high"), "actor/pg_clipfrac_lower": ()},
    CISPO: {"actor/pg_clipfrac": ("clip_frac",), "actor/pg_clipfrac_lower": ()},
    SAPO: {"actor/pg_clipfrac": (), "actor/pg_clipfrac_lower": ()},
    GMPO: {"actor/pg_clipfrac": ("clip_frac_high",), "actor/pg_clipfrac_lower": ("clip_frac_low",)},
    DPPOTV: {"actor/pg_clipfrac": ("is_masked",), "actor/pg_clipfrac_lower": ("is_truncated",)},
    DPPOKL: {"actor/pg_clipfrac": ("is_masked",), "actor/pg_clipfrac_lower": ("is_truncated",)},
    ClipCov: {"actor/pg_clipfrac": ("cov_selected",)},
}
"""verl's clip fractions as sums of packloss metrics with the same meaning, by trust region."""


def _verl_objective(mode: str, config: Any, agg: str, response_length: int) -> PolicyGradient:
    """``from_verl``'s ``"pg"`` objective of ``mode`` without the KL penalty and the entropy bonus
    (verl's ``ppo_loss`` adds those itself)."""
    c = ConfigReader(config, "actor_config")
    policy = c.section("policy_loss").with_overrides(loss_mode=mode)
    actor = c.with_overrides(policy_loss=policy, loss_agg_mode=agg, use_kl_loss=False, entropy_coeff=0.0)
    # global_batch_size / response_length only feed the recipe's constant, which _step replaces
    return from_verl(actor, global_batch_size=1, response_length=response_length).components[POLICY].loss


def _topr(config: Any) -> PolicyGradient:
    """TOPR (Le Roux et al. 2025) with the paper's truncation ``[0, 1]`` of the sequence ratio to π_old."""
    return PolicyGradient(TOPR(low=0.0, high=1.0))


def _dppo(config: Any) -> PolicyGradient:
    """prime-rl's DPPO on verl's ``old_log_prob``: the DPPO-Binary TV mask at ``clip_ratio_low`` /
    ``clip_ratio_high`` and the drift penalty ``1e-3 · (log π − old)²``."""
    low, high = clip_range(ConfigReader(config, "actor_config"))
    return PolicyGradient(DPPOMask(low, high), penalties=(KLPenalty(_DPPO_DRIFT, "squared_log_ratio", "old"),))


ObjectiveBuilder = Callable[[Any], PolicyGradient]
_BUILDERS: dict[str, ObjectiveBuilder] = {"topr": _topr, "dppo": _dppo}
"""packloss-only objectives: ``mode → build(actor_config) -> PolicyGradient``."""


def _objective(mode: str, config: Any, agg: str, response_length: int) -> PolicyGradient:
    if mode not in _BUILDERS:
        return _verl_objective(mode, config, agg, response_length)
    objective = _BUILDERS[mode](config)
    if not isinstance(objective, PolicyGradient):
        raise TypeError(f"the builder of {PREFIX}{mode} must return a PolicyGradient, got {type(objective).__name__}")
    return objective


@dataclass(frozen=True)
class _Step:
    """How one call normalises: the packloss mode, its global count ``D`` (None: this micro-batch's own
    count), a factor on the count (``L`` of seq-mean-token-sum-norm) and one on the loss (``dp``)."""

    normalize: Normalize
    count: float | Tensor | None
    count_scale: float | Tensor = 1.0
    loss_scale: float = 1.0


def _info(info: Mapping[str, Any], key: str, integer: bool = False) -> float | Tensor | None:
    """``global_batch_info[key]``: None, a positive (integer) number, or a tensor (not read)."""
    value = info.get(key)
    if value is None or isinstance(value, Tensor):
        return value
    name = f"config.global_batch_info[{key!r}]"
    if integer and not (isinstance(value, int | float) and not isinstance(value, bool) and value == int(value)):
        raise TypeError(f"{name} must be an int or None, got {value!r}")
    return checks.positive(name, value)


def _step(mode: str, agg: str, config: ConfigReader, rows: int, width: int) -> _Step:
    """verl's ``agg_loss`` for this call as a :class:`_Step`."""
    agg = _OWN_AGGREGATION.get(mode, agg)
    if agg == _ROWS:  # geo_mean: torch.mean over the rows of the call, global_batch_info unused
        return _Step(Normalize.SEQUENCE_MEAN, float(rows))
    info = config.get("global_batch_info", None) or {}
    if not isinstance(info, Mapping):
        raise TypeError(f"config.global_batch_info must be a dict, got {type(info).__name__}")
    dp = _info(info, "dp_size", integer=True)
    if isinstance(dp, Tensor):  # it scales the loss on the host
        raise TypeError("config.global_batch_info['dp_size'] must be an int, got a tensor")
    dp = 1 if dp is None else int(dp)
    if agg == "token-sum":
        return _Step(Normalize.CONSTANT, None, loss_scale=dp)
    if agg == "token-mean":
        count, normalize, needs = _info(info, "batch_num_tokens"), Normalize.TOKEN, "batch_num_tokens"
    else:
        count, needs = _info(info, "global_batch_size", integer=True), "global_batch_size"
        normalize = Normalize.SEQUENCE_MEAN if agg == "seq-mean-token-mean" else Normalize.SEQUENCE_SUM
    if count is None and dp > 1:
        raise ValueError(f"loss_agg_mode={agg!r} with dp_size={dp} needs config.global_batch_info[{needs!r}]")
    scale: float | Tensor = 1.0
    if agg == "seq-mean-token-sum-norm":
        scale = _info(info, "loss_scale_factor")
        if scale is None:
            scale = config.get("loss_scale_factor", None)
        scale = float(width) if scale is None else scale  # verl: the padded response width
    return _Step(normalize, count, scale, float(dp))


def _denominators(plan: Plan, step: _Step) -> StepDenominators:
    """``D`` = the step's global count (or the plan's own) × ``count_scale``; counting the plan also makes
    ``clip_cov`` / ``kl_cov``'s selection (over this micro-batch, as verl)."""
    own = count_denominators([plan])
    if step.normalize is Normalize.CONSTANT:
        return own
    count = own.counts[POLICY] if step.count is None else torch.as_tensor(step.count, dtype=torch.float64)
    if not (isinstance(step.count_scale, float) and step.count_scale == 1.0):
        count = count * torch.as_tensor(step.count_scale, dtype=torch.float64)
    return own.replaced({POLICY: count.to(plan.device).reshape(1)})


def _row_geometric_mean(weights: Tensor, mask: Tensor) -> Tensor:
    """verl's ``geo_mean`` weight of each row, ``exp(Σ_t m log(w + 1e-10) / n)``, on its positions.  ``[B, T]``."""
    w = torch.where(mask, weights.detach(), 1.0)
    log_w = torch.where(mask, torch.log(w + _IS_LOG_EPS), 0.0)  # [B, T]
    mean = log_w.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True, dtype=log_w.dtype).clamp_min(1)
    return torch.exp(mean).expand_as(w)


def packloss_policy_loss(
    mode: str,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss of ``mode`` (a verl loss mode or a packloss-only objective, without the prefix)
    on verl's padded micro-batch, as verl's ``ppo_loss`` calls a policy loss: tensors ``[B, T]``
    (``log_prob`` carries the gradient; ``response_mask`` read as bool), ``config`` the actor config with
    its ``global_batch_info``. Returns ``(loss, metrics)``, 0-d tensors (``bypass_mode`` adds verl's
    ``rollout_corr/*`` floats: :func:`rollout_corr_metrics`); the loss reads nothing on the host and
    its op count does not depend on ``B``. ``rollout_is_weights`` scale each token's loss without changing the
    members (verl's); ``bypass_mode`` ignores them (verl computes its own from ``log_prob``)."""
    if config is None:
        raise ValueError("config must be verl's actor config (ActorConfig, DictConfig or dict), got None")
    checks.choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    if not isinstance(response_mask, Tensor) or response_mask.dim() != 2 or 0 in response_mask.shape:
        shape = list(response_mask.shape) if isinstance(response_mask, Tensor) else type(response_mask).__name__
        raise ValueError(f"response_mask must be a non-empty [B, T] tensor, got {shape}")
    streams = dict(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages)
    check_padded({**streams, "rollout_is_weights": rollout_is_weights}, tuple(response_mask.shape))
    rows, width = response_mask.shape
    c = ConfigReader(config, "actor_config")
    objective = _objective(mode, config, loss_agg_mode, width)
    step = _step(mode, loss_agg_mode, c, rows, width)

    mask = response_mask != 0
    batch = PaddedBatch.of(mask, "rows")  # whole rows: the layout follows from the shape
    weights = None
    if rollout_is_weights is not None and mode != "bypass_mode":
        w = _row_geometric_mean(rollout_is_weights, mask) if mode == "geo_mean" else rollout_is_weights.detach()
        weights = batch.pack(w, "rollout_is_weights")
    constant = 1.0 if step.normalize is Normalize.CONSTANT else None
    component = Component(objective, batch.members, weights, step.normalize, constant, weights_select=False)
    rollout = objective.ratio == "rollout"  # bypass mode: verl's old_log_prob is the rollout's
    plan = batch.plan(
        {POLICY: component},
        rollout_logprobs=old_log_prob if rollout else None,
        old_logprobs=None if rollout else old_log_prob,
        advantages=advantages,
    )
    outputs = batch.outputs(logprobs=log_prob)
    result = compute_loss(plan, outputs, _denominators(plan, step))
    total = result.loss if step.loss_scale == 1.0 else result.loss * step.loss_scale

    own = component_metrics(result.metrics, POLICY)
    base = plan.rollout_logprobs if rollout else plan.old_logprobs
    metrics = {"actor/ppo_kl": own.get("abs_log_ratio", log_ratio_mean(batch.members, base, outputs.logprobs))}
    metrics.update(peer_metrics(own, CLIP_FRACTIONS.get(type(objective.trust_region), {}), rest="actor/packloss/"))
    if mode == "bypass_mode":
        metrics.update(rollout_corr_metrics(c, old_log_prob, log_prob, response_mask))
    return total, metrics


def rollout_corr_metrics(
    c: ConfigReader, rollout_log_prob: Tensor, log_prob: Tensor, response_mask: Tensor
) -> dict[str, float]:
    """The ``rollout_corr/*`` diagnostics verl's ``bypass_mode`` merges into its metrics, from verl's own
    ``compute_rollout_correction_and_rejection_mask`` on ``policy_loss.rollout_correction``, without
    gradient. verl's helper returns host floats: this is the plugin's one device→host read, for metrics
    only (the loss and its gradient read nothing)."""
    # verl imports this plugin while it is itself importing: its helper is reachable only at call time
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    r = c.section("policy_loss").section("rollout_correction")
    with torch.no_grad():
        _, _, metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=log_prob.detach(),
            rollout_log_prob=rollout_log_prob,
            response_mask=response_mask,
            rollout_is=r.get("rollout_is", None),
            rollout_is_threshold=r.get("rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=r.get("rollout_is_batch_normalize", False),
            rollout_rs=r.get("rollout_rs", None),
            rollout_rs_threshold=r.get("rollout_rs_threshold", None),
        )
    return metrics


def policy_loss(mode: str) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """verl's policy-loss function for ``mode`` (no prefix): :func:`packloss_policy_loss` with ``mode``
    bound, named ``packloss_<mode>``."""
    fn = functools.partial(packloss_policy_loss, mode)
    fn.__name__ = fn.__qualname__ = f"{PREFIX}{mode}"  # type: ignore[attr-defined]
    fn.__module__ = __name__
    fn.__doc__ = f"packloss's {mode!r} as a verl policy loss (packloss.integrations.verl.plugin)."
    fn._packloss_mode = mode  # type: ignore[attr-defined]  # marks it as ours across module reloads
    return fn


_FUNCTIONS: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    f"{PREFIX}{mode}": policy_loss(mode) for mode in (*LOSS_MODES, *_BUILDERS)
}
REGISTERED: tuple[str, ...] = tuple(_FUNCTIONS)
"""The names this module registers in verl (``packloss_vanilla``, ..., ``packloss_topr``, ``packloss_dppo``)."""


def register(*, overwrite: bool = False) -> tuple[str, ...]:
    """Register every ``packloss_*`` policy loss in verl's ``POLICY_LOSS_REGISTRY`` (idempotent). A
    name held by a function that is not packloss's is left alone with a warning, unless ``overwrite``.
    Returns the names that now hold packloss's functions. Imports ``verl.trainer.ppo.core_algos``."""
    from verl.trainer.ppo import core_algos  # verl imports this plugin while it is itself importing

    registry = core_algos.POLICY_LOSS_REGISTRY
    done = []
    for name, fn in _FUNCTIONS.items():
        held = registry.get(name)
        if held is not None and held is not fn and getattr(held, "_packloss_mode", None) is None and not overwrite:
            logger.warning("packloss: verl's policy loss %r is already registered by %r; left as it is", name, held)
            continue
        if held is not fn:
            core_algos.register_policy_loss(name)(fn)
        done.append(name)
    return tuple(done)


def register_objective(name: str, build: ObjectiveBuilder, *, overwrite: bool = False) -> str:
    """Add a packloss objective as verl's policy loss ``packloss_<name>``: ``build(actor_config) ->
    PolicyGradient`` runs on every call, normalised by ``loss_agg_mode`` like the others. To have it in
    verl's workers, call this in a module verl imports (``VERL_USE_EXTERNAL_MODULES``). Returns the name."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be an identifier, got {name!r}")
    if not callable(build):
        raise TypeError(f"build must be callable, got {type(build).__name__}")
    if name in LOSS_MODES or (name in _BUILDERS and not overwrite):
        raise ValueError(
            f"{PREFIX}{name} is already a packloss policy loss (pass overwrite=True to replace a custom one)"
        )
    _BUILDERS[name] = build
    full = f"{PREFIX}{name}"
    _FUNCTIONS[full] = policy_loss(name)
    from verl.trainer.ppo import core_algos  # as in register()

    core_algos.register_policy_loss(full)(_FUNCTIONS[full])
    return full


def _register_on_import() -> None:
    """The entry point's work: register the losses and install the ``packloss`` fused-kernel backend
    (:mod:`.head`), and never let a problem fail ``import verl``."""
    try:
        register()
    except Exception as e:  # noqa: BLE001 - a plugin must not break its host's import
        logger.warning("packloss: could not register its policy losses with verl (%s: %s)", type(e).__name__, e)
    try:
        install_head()
    except Exception as e:  # noqa: BLE001 - as above
        logger.warning("packloss: could not install its fused-kernel backend in verl (%s: %s)", type(e).__name__, e)


_register_on_import()
