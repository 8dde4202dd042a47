"""packloss.integrations.verl_plugin: packloss's objectives as verl 0.9.1 policy losses, registered on ``import verl``.

verl imports every entry point of the ``verl.plugins`` group when it is imported; packloss declares this
module as one (``pyproject.toml``). Importing it registers, in verl's ``POLICY_LOSS_REGISTRY``, one
policy loss per objective, so a verl run picks packloss's engine with one override::

    actor_rollout_ref.actor.policy_loss.loss_mode=packloss_vanilla

Registered names (:data:`LOSS_MODES`): ``packloss_<mode>`` for every verl loss mode that
:func:`~packloss.integrations.verl.from_verl` maps (``vanilla``, ``gspo``, ``cispo``, ``gpg``, ``sapo``,
``geo_mean``, ``dppo_tv``, ``dppo_kl``, ``dro``, ``clip_cov``, ``kl_cov``, ``bypass_mode``) and two
objectives verl does not have: ``packloss_topr`` (TOPR, the paper's ``[0, 1]`` truncation) and
``packloss_dppo`` (prime-rl's DPPO: the DPPO-Binary TV mask at ``clip_ratio_low`` / ``clip_ratio_high``
plus the squared-log-ratio drift ``1e-3 · (log π − old)²``). :func:`register_objective` adds more.
Registration is idempotent, leaves a name held by someone else's function alone, and never makes
``import verl`` fail: a problem is logged as a warning.

Each function has verl's signature ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
config, rollout_is_weights) -> (loss, metrics)``, all tensors ``[B, T]``, and is called by verl's
``ppo_loss`` once per micro-batch. It reads the actor config as verl's own loss does (``from_verl``
with the KL and entropy terms left out: ``ppo_loss`` adds those) and ``config.global_batch_info``,
packs the rows of the padded batch into one bin (:class:`~packloss.PaddedLayout`, row ``b`` →
sequence ``b``; whole rows, so the layout comes from the shape and nothing is read on the host) and
computes ``compute_loss`` on it with denominators that are verl's. With ``ℓ`` the per-token policy
loss, ``w`` verl's ``rollout_is_weights`` (1 when None), ``m`` the response mask, ``n_s`` the members
of row ``s`` and ``dp, N_tok, G, L`` = ``dp_size, batch_num_tokens, global_batch_size,
loss_scale_factor`` (``L`` falls back to the config's, then to ``T``)::

    token-mean               dp · Σ m w ℓ / N_tok              (N_tok None: the micro-batch's members)
    token-sum                dp · Σ m w ℓ
    seq-mean-token-sum       dp · Σ m w ℓ / G                  (G None: its rows with members)
    seq-mean-token-mean      dp · Σ_s (Σ_{t∈s} m w ℓ / n_s) / G
    seq-mean-token-sum-norm  dp · Σ m w ℓ / (G · L)
    sapo                     as seq-mean-token-mean, whatever loss_agg_mode says (verl's rule)
    geo_mean                 Σ_s (Σ_{t∈s} m w_s ℓ / n_s) / B   (the call's B rows; no dp, no G: verl's rule)

which is verl's ``agg_loss`` with the same ``global_batch_info``, so the sum of the micro-batches'
gradients is verl's step gradient. ``w`` multiplies the whole per-token policy loss without changing
the members (a zero weight keeps its token in ``n_s`` and in GSPO's sequence mean, as in verl); for
``geo_mean`` it is verl's per-row geometric mean ``w_s = exp(Σ_{t∈s} m log(w + 1e-10) / n_s)``;
``bypass_mode`` ignores it (verl computes its own weights from the live ``log_prob``). ``dp > 1``
without ``N_tok`` (token-mean) or ``G`` (seq-mean modes) is a ``ValueError``, as in verl.

Where the result differs from verl's native mode, it is packloss's objective that differs (the notes
of :func:`~packloss.integrations.verl.from_verl`): verl's clamps of ``log r`` (``vanilla`` at ``−20``,
``gspo`` at ``10``); ``clip_cov`` / ``kl_cov`` select their tokens over the micro-batch from the *old*
log-probs (``clip_cov``: the ``k`` of largest covariance) where verl uses the live ``log_prob``
(``clip_cov``: ``k`` drawn at random); they agree on the first epoch when ``k`` covers the band. The
response mask is read as bool (``ppo_loss`` passes bool). Values off the response mask may be anything
(inf, NaN): they change neither the loss, the gradient nor the metrics.

Metrics are 0-d tensors (no host read here; verl's ``Metric`` reads them later): verl's names where
the quantity is verl's (``actor/ppo_kl``: the mean of ``old − log π`` over the members, ``|log π −
old|`` for ``kl_cov``; ``actor/pg_clipfrac`` and ``actor/pg_clipfrac_lower`` for the modes whose clip
fractions packloss reports with verl's meaning), and every packloss metric of the objective as
``actor/packloss/<name>``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from packloss import (
    Component,
    KLPenalty,
    Normalize,
    Outputs,
    PaddedLayout,
    Plan,
    PolicyGradient,
    StepDenominators,
    compute_loss,
    count_denominators,
)
from packloss.core.bin import ComponentInputs, ComponentOutput, upcast
from packloss.core.segments import broadcast, segment_sum
from packloss.core.selection import ClipCov
from packloss.core.trust_regions import DPPOKL, DPPOTV, GMPO, GSPO, TOPR, DPPOMask, PPOClip
from packloss.integrations import verl as _verl
from packloss.integrations.verl import LOSS_AGG_MODES, from_verl

_VERL_MODES = _verl.LOSS_MODES  # verl 0.9.1's loss modes, all mapped by from_verl
_get, _clip_range = _verl._get, _verl._clip_range  # from_verl's own duck-typed config reading

__all__ = [
    "PREFIX",
    "LOSS_MODES",
    "register",
    "register_objective",
    "policy_loss",
    "packloss_policy_loss",
]

logger = logging.getLogger(__name__)

PREFIX = "packloss_"
"""The prefix of every policy loss this module registers in verl."""

_COMPONENT = "pg"
_SEQUENCE_MEAN_AGG = "seq-mean-token-mean"  # what sapo aggregates by, whatever loss_agg_mode says
_ROWS = "rows"  # geo_mean: the mean over the call's rows
_OWN_AGGREGATION = {"sapo": _SEQUENCE_MEAN_AGG, "geo_mean": _ROWS}
_IS_LOG_EPS = 1e-10  # verl's log(w + 1e-10) in geo_mean's geometric mean of the weights
_DPPO_DRIFT = 1e-3  # prime-rl's kl_tau


# ---------------------------------------------------------------------------------------------------
# Objectives: verl's loss modes (through from_verl) and packloss's own
# ---------------------------------------------------------------------------------------------------


class _Overlay:
    """A config that reads as ``base`` except for the keys in ``changes`` (attribute access, as
    :func:`~packloss.integrations.verl.from_verl` reads a dataclass). A key ``base`` lacks raises
    ``AttributeError``, so ``from_verl`` takes its default."""

    def __init__(self, base: Any, **changes: Any) -> None:
        self.__dict__["_base"] = {} if base is None else base
        self.__dict__["_changes"] = changes

    def __getattr__(self, key: str) -> Any:
        changes, base = self.__dict__["_changes"], self.__dict__["_base"]
        if key in changes:
            return changes[key]
        value = _get(base, key, _Overlay)  # _Overlay itself marks "absent"
        if value is _Overlay:
            raise AttributeError(key)
        return value


def _verl_objective(mode: str, config: Any, agg: str, response_length: int) -> PolicyGradient:
    """The policy-gradient objective of verl's ``mode`` from ``config`` (``from_verl``'s ``"pg"`` part,
    without the KL penalty and the entropy bonus, which verl's ``ppo_loss`` adds itself)."""
    policy = _Overlay(_get(config, "policy_loss", {}), loss_mode=mode)
    actor = _Overlay(config, policy_loss=policy, loss_agg_mode=agg, use_kl_loss=False, entropy_coeff=0.0)
    # global_batch_size / response_length only feed the recipe's constant, which is replaced below
    recipe = from_verl(actor, global_batch_size=1, response_length=response_length)
    return recipe.parts[_COMPONENT].loss


def _topr(config: Any) -> PolicyGradient:
    """TOPR (Le Roux et al. 2025) with the paper's truncation ``[0, 1]`` of the sequence ratio to π_old."""
    return PolicyGradient(TOPR(low=0.0, high=1.0))


def _dppo(config: Any) -> PolicyGradient:
    """prime-rl's DPPO: drop ``A > 0 & π − π_old > clip_ratio_high`` and ``A ≤ 0 & π − π_old <
    −clip_ratio_low``; drift penalty ``1e-3 · (log π − old)²`` (prime-rl's ``kl_tau``). prime-rl measures
    both against π_rollout; here against verl's ``old_log_prob`` (π_rollout in bypass mode)."""
    low, high = _clip_range(config)
    return PolicyGradient(DPPOMask(low, high), penalties=(KLPenalty(_DPPO_DRIFT, "squared_log_ratio", "old"),))


ObjectiveBuilder = Callable[[Any], PolicyGradient]
_BUILDERS: dict[str, ObjectiveBuilder] = {"topr": _topr, "dppo": _dppo}
"""packloss-only objectives: ``mode → build(actor_config) -> PolicyGradient``."""


def _objective(mode: str, config: Any, agg: str, response_length: int) -> PolicyGradient:
    if mode in _BUILDERS:
        objective = _BUILDERS[mode](config)
        if not isinstance(objective, PolicyGradient):
            raise TypeError(
                f"the builder of {PREFIX}{mode} must return a PolicyGradient, got {type(objective).__name__}"
            )
        return objective
    return _verl_objective(mode, config, agg, response_length)


# ---------------------------------------------------------------------------------------------------
# verl's rollout_is_weights on the per-token loss
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Reweighted:
    """A component loss: ``objective``'s per-token loss times verl's ``rollout_is_weights`` (``[N]``),
    the members left as they are (``Component.weights`` would drop zero-weight tokens from the members,
    hence from ``n_s`` and from sequence statistics, where verl keeps them). With ``per_sequence`` the
    weight of a token is its row's geometric mean ``exp(Σ_m log(w + 1e-10) / n_s)`` (verl's
    ``geo_mean``). The objective's fields stay readable (step selection reads them)."""

    objective: PolicyGradient
    weights: Tensor
    per_sequence: bool = False

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        out = self.objective(inputs)
        m = inputs.loss_mask  # [N]
        w = torch.where(m, upcast(self.weights.detach()), 1.0)  # [N]; anything off the members
        if self.per_sequence:
            log_w = torch.where(m, torch.log(w + _IS_LOG_EPS), 0.0)  # [N]
            count = segment_sum(m.to(log_w.dtype), inputs.seq_ids, inputs.num_seqs).clamp_min(1)  # [S]
            w = broadcast(torch.exp(segment_sum(log_w, inputs.seq_ids, inputs.num_seqs) / count), inputs.seq_ids)
        out.per_token = out.per_token * torch.where(m, w, 0.0)
        return out

    def check_plan(self, plan: Plan, name: str) -> None:
        self.objective.check_plan(plan, name)

    @property
    def trust_region(self):
        return self.objective.trust_region

    @property
    def ratio(self) -> str:
        return self.objective.ratio

    @property
    def advantage(self) -> str:
        return self.objective.advantage

    @property
    def adv_coef(self) -> float:
        return self.objective.adv_coef


# ---------------------------------------------------------------------------------------------------
# verl's normalisation as step denominators
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Step:
    """How one call normalises: the packloss mode, its global count ``D`` (None: this micro-batch's own
    count), a factor on the count (``L`` of seq-mean-token-sum-norm) and one on the loss (``dp``)."""

    normalize: Normalize
    count: float | Tensor | None
    count_scale: float | Tensor = 1.0
    loss_scale: float = 1.0


def _info_number(info: Mapping[str, Any], key: str, integer: bool = False) -> float | Tensor | None:
    """``global_batch_info[key]``: None, a positive (integer) number, or a tensor (not read)."""
    value = info.get(key)
    if value is None or isinstance(value, Tensor):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or (integer and value != int(value)):
        kind = "an int" if integer else "a number"
        raise TypeError(f"config.global_batch_info[{key!r}] must be {kind} or None, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"config.global_batch_info[{key!r}] must be finite and > 0, got {value}")
    return value


def _step(mode: str, agg: str, config: Any, rows: int, width: int) -> _Step:
    """verl's ``agg_loss`` for this call (module doc) as a :class:`_Step`."""
    agg = _OWN_AGGREGATION.get(mode, agg)
    if agg == _ROWS:  # geo_mean: torch.mean over the rows of the call, global_batch_info unused
        return _Step(Normalize.SEQUENCE_MEAN, float(rows))
    info = _get(config, "global_batch_info", None) or {}
    if not isinstance(info, Mapping):
        raise TypeError(f"config.global_batch_info must be a dict, got {type(info).__name__}")
    dp = _info_number(info, "dp_size", integer=True)
    if isinstance(dp, Tensor):  # it scales the loss on the host
        raise TypeError("config.global_batch_info['dp_size'] must be an int, got a tensor")
    dp = 1 if dp is None else int(dp)
    if agg == "token-sum":
        return _Step(Normalize.CONSTANT, None, loss_scale=dp)
    if agg == "token-mean":
        count, normalize, needs = _info_number(info, "batch_num_tokens"), Normalize.TOKEN, "batch_num_tokens"
    else:
        count, needs = _info_number(info, "global_batch_size", integer=True), "global_batch_size"
        normalize = Normalize.SEQUENCE_MEAN if agg == "seq-mean-token-mean" else Normalize.SEQUENCE_SUM
    if count is None and dp > 1:
        raise ValueError(f"loss_agg_mode={agg!r} with dp_size={dp} needs config.global_batch_info[{needs!r}]")
    scale: float | Tensor = 1.0
    if agg == "seq-mean-token-sum-norm":
        scale = _info_number(info, "loss_scale_factor")
        if scale is None:
            scale = _get(config, "loss_scale_factor", None)
        scale = float(width) if scale is None else scale  # verl: the padded response width
    return _Step(normalize, count, scale, float(dp))


def _denominators(plan: Plan, step: _Step) -> StepDenominators:
    """The plan's denominators with ``D`` = the step's global count (or the plan's own) × ``count_scale``.
    Counting the plan also makes the token selection of ``clip_cov`` / ``kl_cov`` (over this
    micro-batch, as verl's)."""
    own = count_denominators([plan])
    if step.normalize is Normalize.CONSTANT:
        return own
    counts = own.counts[_COMPONENT]  # [1] float64
    if step.count is not None:
        counts = torch.as_tensor(step.count, dtype=torch.float64, device=counts.device).reshape(1)
    if not (isinstance(step.count_scale, float) and step.count_scale == 1.0):
        counts = counts * torch.as_tensor(step.count_scale, dtype=torch.float64, device=counts.device)
    return StepDenominators(own.modes, {_COMPONENT: counts}, own.num_groups, own.selections)


# ---------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------

# verl's clip fractions as sums of packloss metrics with the same meaning, by trust region
_CLIP_FRACTIONS: dict[type, dict[str, tuple[str, ...]]] = {
    PPOClip: {"actor/pg_clipfrac": ("clip_frac_low", "clip_frac_high"), "actor/pg_clipfrac_lower": ("dual_clip_frac",)},
    GSPO: {"actor/pg_clipfrac": ("clip_frac_low", "clip_frac_high")},
    GMPO: {"actor/pg_clipfrac": ("clip_frac_high",), "actor/pg_clipfrac_lower": ("clip_frac_low",)},
    DPPOTV: {"actor/pg_clipfrac": ("is_masked",), "actor/pg_clipfrac_lower": ("is_truncated",)},
    DPPOKL: {"actor/pg_clipfrac": ("is_masked",), "actor/pg_clipfrac_lower": ("is_truncated",)},
    ClipCov: {"actor/pg_clipfrac": ("cov_selected",)},
}


def _metrics(objective: PolicyGradient, own: Mapping[str, Tensor], ppo_kl: Tensor) -> dict[str, Tensor]:
    """verl's names where the quantity is verl's, and packloss's as ``actor/packloss/<name>``."""
    prefix = f"{_COMPONENT}/"
    named = {k[len(prefix) :]: v.detach() for k, v in own.items() if k.startswith(prefix)}
    out = {"actor/ppo_kl": named.get("abs_log_ratio", ppo_kl)}  # kl_cov reports verl's mean |log r|
    for verl_name, parts in _CLIP_FRACTIONS.get(type(objective.trust_region), {}).items():
        if all(p in named for p in parts):
            total = named[parts[0]]
            for p in parts[1:]:
                total = total + named[p]
            out[verl_name] = total
    out.update({f"actor/packloss/{k}": v for k, v in named.items()})
    return out


# ---------------------------------------------------------------------------------------------------
# The policy loss
# ---------------------------------------------------------------------------------------------------


def _check_batch(tensors: Mapping[str, Tensor | None], shape: torch.Size) -> None:
    for name, value in tensors.items():
        if value is None:
            continue
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if value.shape != shape:
            raise ValueError(f"{name} must have response_mask's shape [B, T] = {list(shape)}, got {list(value.shape)}")


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
    """The policy loss of ``mode`` (a verl loss mode or a packloss-only objective, without the
    ``packloss_`` prefix) on verl's padded micro-batch, as verl's ``ppo_loss`` calls a policy loss.

    Args:
        mode: ``"vanilla"``, ..., ``"bypass_mode"``, ``"topr"``, ``"dppo"`` (:data:`LOSS_MODES` without
            the prefix) or a name added with :func:`register_objective`.
        old_log_prob, log_prob, advantages: ``[B, T]``; ``log_prob`` carries the gradient.
        response_mask: ``[B, T]``, the tokens of the loss (read as bool).
        loss_agg_mode: verl's aggregation (module doc).
        config: the actor config (``ActorConfig``, a ``DictConfig`` or a dict) with its
            ``global_batch_info`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
            ``loss_scale_factor``), as ``ppo_loss`` fills it.
        rollout_is_weights: ``[B, T]`` or None, the trainer's rollout-correction weights.

    Returns ``(loss, metrics)``: the 0-d loss (float32 at least; float64 stays) and 0-d tensor metrics.
    No device→host read; the number of tensor operations does not depend on ``B``.
    """
    if config is None:
        raise ValueError("config must be verl's actor config (ActorConfig, DictConfig or dict), got None")
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    if not isinstance(response_mask, Tensor) or response_mask.dim() != 2 or 0 in response_mask.shape:
        shape = list(response_mask.shape) if isinstance(response_mask, Tensor) else type(response_mask).__name__
        raise ValueError(f"response_mask must be a non-empty [B, T] tensor, got {shape}")
    _check_batch(
        {
            "old_log_prob": old_log_prob,
            "log_prob": log_prob,
            "advantages": advantages,
            "rollout_is_weights": rollout_is_weights,
        },
        response_mask.shape,
    )
    rows, width = response_mask.shape
    objective = _objective(mode, config, loss_agg_mode, width)
    step = _step(mode, loss_agg_mode, config, rows, width)

    # whole rows: the layout follows from the shape (no host read), member-less rows stay as sequences
    attended = torch.ones_like(response_mask, dtype=torch.bool)
    layout = PaddedLayout.from_attention_mask(attended, seq_lens=[width] * rows)
    m = layout.pack(response_mask, "response_mask") != 0  # [N]
    old = layout.pack(old_log_prob.detach(), "old_log_prob")  # [N]
    trn = layout.pack(log_prob, "log_prob")  # [N]
    loss = objective
    if rollout_is_weights is not None and mode != "bypass_mode":  # bypass: verl's weights come from log_prob
        weights = layout.pack(rollout_is_weights.detach(), "rollout_is_weights")
        loss = _Reweighted(objective, weights, per_sequence=mode == "geo_mean")
    constant = 1.0 if step.normalize is Normalize.CONSTANT else None
    rollout = objective.ratio == "rollout"  # bypass mode: verl's old_log_prob is the rollout's
    plan = Plan(
        layout.seq_lens,
        {_COMPONENT: Component(loss, mask=m, normalize=step.normalize, constant=constant)},
        inference_logprobs=old if rollout else None,
        old_logprobs=None if rollout else old,
        advantages=layout.pack(advantages.detach(), "advantages"),
    )
    result = compute_loss(plan, Outputs(logprobs=trn), _denominators(plan, step))
    total = result.loss if step.loss_scale == 1.0 else result.loss * step.loss_scale

    members = m.sum(dtype=torch.float32).clamp_min(1)
    base = upcast(old)
    ppo_kl = torch.where(m, base - upcast(trn.detach()), 0.0).sum() / members  # masked before the sum
    return total, _metrics(objective, result.metrics, ppo_kl)


def policy_loss(mode: str) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """verl's policy-loss function for ``mode`` (no prefix): :func:`packloss_policy_loss` with verl's
    signature, named ``packloss_<mode>``."""

    def fn(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return packloss_policy_loss(
            mode, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
        )

    fn.__name__ = fn.__qualname__ = f"{PREFIX}{mode}"
    fn.__doc__ = f"packloss's {mode!r} as a verl policy loss (packloss.integrations.verl_plugin)."
    fn._packloss_mode = mode  # type: ignore[attr-defined]  # marks it as ours across module reloads
    return fn


# ---------------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------------

_FUNCTIONS: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    f"{PREFIX}{mode}": policy_loss(mode) for mode in (*_VERL_MODES, *_BUILDERS)
}
LOSS_MODES: tuple[str, ...] = tuple(_FUNCTIONS)
"""The names this module registers in verl (``packloss_vanilla``, ..., ``packloss_topr``, ``packloss_dppo``)."""


def register(*, overwrite: bool = False) -> tuple[str, ...]:
    """Register every ``packloss_*`` policy loss in verl's ``POLICY_LOSS_REGISTRY`` (idempotent).

    A name already held by a function that is not packloss's is left alone with a warning, unless
    ``overwrite``. Returns the names that now hold packloss's functions. Imports
    ``verl.trainer.ppo.core_algos`` (``import verl`` alone does not).
    """
    from verl.trainer.ppo import core_algos

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
    """Add a packloss objective as verl's policy loss ``packloss_<name>``.

    ``build(actor_config) -> PolicyGradient`` runs on every call (read the config there). The loss is
    normalised by ``loss_agg_mode`` with ``global_batch_info`` like the others. To have it in verl's
    workers, call this in a module verl imports (``VERL_USE_EXTERNAL_MODULES``). Returns the name.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be an identifier, got {name!r}")
    if not callable(build):
        raise TypeError(f"build must be callable, got {type(build).__name__}")
    if name in _VERL_MODES or (name in _BUILDERS and not overwrite):
        raise ValueError(
            f"{PREFIX}{name} is already a packloss policy loss (pass overwrite=True to replace a custom one)"
        )
    _BUILDERS[name] = build
    full = f"{PREFIX}{name}"
    _FUNCTIONS[full] = policy_loss(name)
    from verl.trainer.ppo import core_algos

    core_algos.register_policy_loss(full)(_FUNCTIONS[full])
    return full


def _register_on_import() -> None:
    """The entry point's work: register, and never let a problem fail ``import verl``."""
    try:
        register()
    except Exception as e:  # noqa: BLE001 - a plugin must not break its host's import
        logger.warning("packloss: could not register its policy losses with verl (%s: %s)", type(e).__name__, e)


_register_on_import()
