"""TRL 1.16's ``GRPOTrainer`` with its loss and LM head computed by packloss: :class:`PacklossGRPOTrainer`.

Everything but the loss and the LM head is TRL's. ``_compute_loss`` runs TRL's forward, packs TRL's padded
completion batch into one bin (row ``b`` → sequence ``b``; reading the ``B`` row lengths is one device→host
read) and computes ``from_trl(args)``'s loss with TRL's denominators (``packloss_normalization="trl"``, the
default) or packloss's step denominators (``"step"``). With ``packloss_head=True`` (the default) every
log-prob and entropy TRL computes — the policy's, the old policy's, the reference model's — comes from
packloss's fused head at the completion positions (:mod:`.head`). The streams, both normalisations, the
head and the metrics: ``docs/integrations/trl.md``.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, replace
from typing import Any

import torch
from accelerate.utils import is_peft_model
from torch import Tensor
from trl import GRPOTrainer

from packloss.core import checks
from packloss.core.bin import Component, Normalize, Plan
from packloss.core.engine import LossResult, compute_loss
from packloss.core.entropy import Entropy
from packloss.core.outputs import Outputs
from packloss.core.recipe import POLICY, Recipe
from packloss.core.step import StepDenominators, count_denominators
from packloss.integrations.common.padded import PaddedBatch
from packloss.integrations.trl.config import from_trl
from packloss.integrations.trl.head import HeadCall, install_head

__all__ = ["PacklossGRPOTrainer", "NORMALIZATIONS", "TRL_METRICS"]

NORMALIZATIONS = ("trl", "step")
"""The values of ``PacklossGRPOTrainer(packloss_normalization=...)``."""

# the batch entries TRL's forward takes besides the ids and the mask (multimodal models)
_FORWARD_KWARGS = tuple(
    "pixel_values image_grid_thw num_images pixel_attention_mask spatial_shapes num_tiles image_sizes "
    "token_type_ids mm_token_type_ids image_position_ids".split()
)
_PPO_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
_GENERATION_TOKEN_MEAN = ("dapo", "cispo", "vespo")  # TRL divides by num_items_in_batch


@dataclass(frozen=True)
class TrlMetric:
    """How a TRL metric comes from packloss's per-sequence metrics: the sum of ``sources`` reduced by
    ``reduce`` — ``"ratio"`` (TRL's ratio mean: over tokens, or over rows at sequence level),
    ``"rows"`` (over rows), ``"min"`` / ``"max"`` (over the sequences) — with ``empty`` TRL's value
    for a row without a loss token (None: such a row does not count)."""

    sources: tuple[str, ...]
    reduce: str
    empty: float | None = None
    empty_at_sequence_level: float | None = None


TRL_METRICS: dict[str, dict[str, TrlMetric]] = {
    "ppo": {
        "clip_ratio/low_mean": TrlMetric(("clip_frac_low",), "ratio"),
        "clip_ratio/high_mean": TrlMetric(("clip_frac_high",), "ratio"),
        "clip_ratio/region_mean": TrlMetric(("clip_frac_low", "clip_frac_high"), "ratio"),  # disjoint: A < 0, A > 0
        "clip_ratio/low_min": TrlMetric(("clip_frac_low",), "min", empty_at_sequence_level=0.0),
        "clip_ratio/high_max": TrlMetric(("clip_frac_high",), "max", empty_at_sequence_level=0.0),
    },
    "cispo": {"cispo_clip_ratio": TrlMetric(("clip_frac_high",), "ratio")},
    "vespo": {"vespo/phi_seq_mean": TrlMetric(("phi",), "rows", empty=1.0)},  # an empty row's w is 1: φ(1) = 1
    "sapo": {},
}
"""TRL's loss metrics by loss-type family, as data (``entropy``, ``kl``, ``policy_loss`` are added by
rule, every packloss metric as ``packloss/<name>``)."""


def _check_normalization(config: Any, normalization: str) -> None:
    checks.choice("PacklossGRPOTrainer.packloss_normalization", normalization, NORMALIZATIONS)
    if normalization == "step" and config.steps_per_generation % config.gradient_accumulation_steps:
        raise ValueError(
            "PacklossGRPOTrainer.packloss_normalization='step' needs GRPOConfig.steps_per_generation "
            f"({config.steps_per_generation}) to be a multiple of gradient_accumulation_steps "
            f"({config.gradient_accumulation_steps}): a step's micro-batches must come from one generation"
        )
    bonus = config.entropy_coef != 0 or config.use_adaptive_entropy
    if normalization == "step" and config.top_entropy_quantile < 1 and bonus:
        raise NotImplementedError(
            "PacklossGRPOTrainer.packloss_normalization='step' with top_entropy_quantile < 1 and an entropy bonus: "
            "the bonus is a mean over the kept tokens, which the step's denominators, counted before the "
            "forward, cannot know; use packloss_normalization='trl'"
        )


class PacklossGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` whose loss is packloss's ``from_trl(args)`` recipe and whose log-probs and
    entropy come from packloss's fused head.

    Takes ``GRPOTrainer``'s arguments, ``packloss_normalization`` (``"trl"``, default, or ``"step"``) and
    ``packloss_head`` (True, default: packloss's head for the policy and the reference model; False:
    TRL's). Options ``from_trl`` does not map raise ``NotImplementedError`` before any model loads; a
    model whose output layer packloss's head cannot compute raises once loaded (the message names
    ``packloss_head=False``). Attributes: ``packloss_recipe`` (the :class:`~packloss.Recipe`),
    ``packloss_normalization``, ``packloss_head``.
    """

    def __init__(
        self, *args: Any, packloss_normalization: str = "trl", packloss_head: bool = True, **kwargs: Any
    ) -> None:
        config = inspect.signature(GRPOTrainer.__init__).bind(None, *args, **kwargs).arguments.get("args")
        checks.flag("PacklossGRPOTrainer.packloss_head", packloss_head)
        if config is not None:  # fail before the models load
            from_trl(config)
            _check_normalization(config, packloss_normalization)
        super().__init__(*args, **kwargs)
        self._init_packloss(packloss_normalization)
        self._init_packloss_head(packloss_head)

    def _init_packloss(self, normalization: str) -> None:
        """The recipe and the normalisation mode, from ``self.args`` (``GRPOTrainer.__init__`` has run)."""
        _check_normalization(self.args, normalization)
        self.packloss_normalization = normalization
        self.packloss_recipe: Recipe = from_trl(self.args, num_processes=self.accelerator.num_processes)
        self._packloss_windows: list[StepDenominators] = []

    def _init_packloss_head(self, enabled: bool) -> None:
        """Put packloss's head into the models TRL patched with its own (the policy's base model under
        PEFT, the reference model when there is one)."""
        self.packloss_head = enabled
        if not enabled:
            return
        if self.aux_loss_enabled:
            raise NotImplementedError(
                "PacklossGRPOTrainer(packloss_head=True) does not compute the MoE load-balancing loss "
                "(router_aux_loss_coef != 0); pass packloss_head=False to keep TRL's head"
            )
        install_head(self.model.get_base_model() if is_peft_model(self.model) else self.model)
        if self.ref_model is not None:
            install_head(self.accelerator.unwrap_model(self.ref_model))

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: Tensor,
        attention_mask: Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """TRL's method (its batching, multimodal inputs and autocast) with the model called with
        ``packloss_head=HeadCall(...)``: TRL calls ``model`` once per chunk and reads only its output."""
        if self.packloss_head:
            entropy_grad = compute_entropy and self._entropy_bonus_enabled
            call = HeadCall(logits_to_keep, float(self.temperature), compute_entropy, entropy_grad)
            model = functools.partial(model, packloss_head=call)
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **kwargs
        )

    # -----------------------------------------------------------------------------------------------
    # TRL's batch → a packloss bin
    # -----------------------------------------------------------------------------------------------

    def _accumulation(self, mode: str) -> int:
        return self.current_gradient_accumulation_steps if mode == "train" else 1

    def _trl_rules(self, mode: str) -> bool:
        return self.packloss_normalization == "trl" or mode == "eval"

    def _components(self, members: Tensor, rows: int, mode: str, entropy: Tensor | None) -> dict[str, Component]:
        components = self.packloss_recipe.for_bin(members)
        for name, comp in components.items():
            if comp.constant is not None and self._trl_rules(mode):
                # from_trl's constant counts the configured rows and accumulation; TRL counts this call's
                configured = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
                constant = comp.constant * rows * self._accumulation(mode) / configured
                components[name] = Component(comp.loss, members, None, comp.normalize, constant)
        if entropy is not None:
            self._keep_high_entropy(components, members, entropy)
        return components

    def _keep_high_entropy(self, components: dict[str, Component], members: Tensor, entropy: Tensor) -> None:
        """TRL's high-entropy mask (``top_entropy_quantile < 1``), in place: the policy gradient's threshold
        over this call's loss tokens on every rank (``entropy [N]``; with several processes one
        ``all_gather``, sized by one ``all_reduce`` and host read, as TRL's ``pad_across_processes``), and
        the entropy bonus over the kept tokens (TRL's ``mask * entropy_mask``)."""
        pg = components[POLICY]
        top = pg.loss.top_entropy
        if top is None:
            return
        top = top.over([entropy], [members], all_gather=self.accelerator.num_processes > 1)
        components[POLICY] = replace(pg, loss=replace(pg.loss, top_entropy=top))
        if "entropy" in components:
            components["entropy"] = replace(components["entropy"], mask=top.keep(entropy, members))

    def _packloss_plan(
        self, inputs: dict[str, Any], mode: str, entropies: Tensor | None = None
    ) -> tuple[Plan, PaddedBatch]:
        """The plan of TRL's micro-batch ``inputs`` and the batch that packs its ``[B, T]`` tensors; with
        the forward's ``entropies`` ``[B, T]``, the high-entropy mask's threshold (:meth:`_keep_high_entropy`)."""
        completion_mask = inputs["completion_mask"]  # [B, T]
        loss_mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        rows, width = completion_mask.shape
        batch = PaddedBatch.of(loss_mask.bool(), "members", positions=completion_mask.bool())
        advantages = inputs["advantages"]
        if advantages.dim() == 1:  # one per completion (TRL); [B, T] from subclasses
            advantages = advantages[:, None].expand(rows, width)
        old, sampling = inputs.get("old_per_token_logps"), inputs.get("sampling_per_token_logps")
        if sampling is not None and old is not None:
            sampling = torch.where(torch.isnan(sampling), old, sampling)  # vLLM gave no log-prob: ρ = 1, as TRL
        plan = batch.plan(
            self._components(batch.members, rows, mode, batch.pack(entropies, "entropies")),
            rollout_logprobs=sampling,
            old_logprobs=old,
            ref_logprobs=inputs.get("ref_per_token_logps"),
            advantages=advantages,
        )
        return plan, batch

    def _trl_denominators(self, plan: Plan, inputs: dict[str, Any], mode: str) -> StepDenominators:
        """TRL's normalisers of this call as step counts (``docs/integrations/trl.md``)."""
        accumulation, world = self._accumulation(mode), self.accelerator.num_processes
        per_generation = self.args.steps_per_generation if mode == "train" else 1
        counts = {}
        for name, comp in plan.components.items():
            members = plan.members[name]
            if comp.normalize is Normalize.CONSTANT:
                continue
            if comp.normalize is Normalize.SEQUENCE_MEAN:
                rows = float(plan.num_seqs * accumulation * world)
                count = torch.full((1,), rows, dtype=torch.float64, device=members.device)
            elif self.loss_type in _GENERATION_TOKEN_MEAN and not isinstance(comp.loss, Entropy):
                items = inputs["num_items_in_batch"].to(members.device, torch.float64).reshape(1)
                count = items * (accumulation / per_generation)
            else:  # bnpo and the entropy bonus: this micro-batch's token mean, / G
                count = members.sum(dtype=torch.float64).reshape(1) * (accumulation * world)
            counts[name] = count
        return count_denominators([plan]).replaced(counts)

    def _denominators(self, plan: Plan, inputs: dict[str, Any], mode: str) -> StepDenominators:
        if self._trl_rules(mode):
            return self._trl_denominators(plan, inputs, mode)
        window = (self._step % self.args.steps_per_generation) // self.args.gradient_accumulation_steps
        return self._packloss_windows[window]

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self.packloss_normalization == "step" and self.model.training and self._buffered_inputs is not buffered:
            # a new generation: count the denominators of each of its optimizer steps
            plans = [self._packloss_plan(batch, "train")[0] for batch in self._buffered_inputs]
            g, world = self.args.gradient_accumulation_steps, self.accelerator.num_processes
            self._packloss_windows = [
                count_denominators(plans[i : i + g], all_reduce=world > 1) for i in range(0, len(plans), g)
            ]
        return inputs

    # -----------------------------------------------------------------------------------------------
    # The loss
    # -----------------------------------------------------------------------------------------------

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
        mode = "train" if self.model.training else "eval"
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in _FORWARD_KWARGS},
        )
        plan, batch = self._packloss_plan(inputs, mode, entropies)
        outputs = batch.outputs(logprobs=per_token_logps, entropy=entropies)
        if self.use_adaptive_entropy:
            self._apply_entropy_coef()
        result = compute_loss(plan, outputs, self._denominators(plan, inputs, mode), per_sequence_metrics=True)
        if self.use_adaptive_entropy and mode == "train":
            self._update_entropy_coef(plan, outputs)
        # packloss: this rank's share of the step's loss, summed over ranks; accelerate's DDP averages
        loss = result.loss * self.accelerator.num_processes
        if self.aux_loss_enabled:  # the MoE load-balancing loss, as TRL adds it
            loss = loss + self.router_aux_loss_coef * aux_loss / self._accumulation(mode)
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())  # noqa: E501  # sync-ok: TRL logging
        self._log_packloss_metrics(result, plan, outputs, mode)
        return loss

    def _apply_entropy_coef(self) -> None:
        """TRL's adaptive entropy control, the coefficient applied in this call: TRL's current
        ``entropy_coef`` while the last optimizer step's entropy was at or below ``entropy_target``, else 0
        (host floats, written into the recipe's 0-d coefficient)."""
        coef = self.packloss_recipe.components["entropy"].loss.coef
        on = self._last_world_entropy <= self.args.entropy_target
        coef.fill_(self.entropy_coef if on else 0.0)

    def _update_entropy_coef(self, plan: Plan, outputs: Outputs) -> None:
        """TRL's controller update: the entropy sum and member count of every micro-batch of the optimizer
        step, reduced over the ranks at its last micro-batch, move ``entropy_coef`` by
        ``entropy_coef_delta`` towards more entropy bonus when the step's entropy is at or below the
        target (less otherwise), within ``[entropy_coef_min, entropy_coef_max]``."""
        members = plan.members["entropy"]
        entropy = torch.where(members, outputs.entropy.detach(), 0.0)
        stats = torch.stack([entropy.sum(dtype=torch.float64), members.sum(dtype=torch.float64)])
        window = self._entropy_window_stats
        self._entropy_window_stats = stats if window is None else window + stats.to(window.device)
        if not self.accelerator.sync_gradients:
            return
        total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = (total[0] / total[1].clamp(min=1.0)).item()  # sync-ok: TRL's controller, once a step
        a = self.args
        if world_entropy <= a.entropy_target:
            self.entropy_coef = min(self.entropy_coef + a.entropy_coef_delta, a.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - a.entropy_coef_delta, a.entropy_coef_min)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None

    # -----------------------------------------------------------------------------------------------
    # Metrics
    # -----------------------------------------------------------------------------------------------

    def _family(self) -> str:
        return "ppo" if self.loss_type in _PPO_FAMILY else self.loss_type

    def _log_packloss_metrics(self, result: LossResult, plan: Plan, outputs: Outputs, mode: str) -> None:
        """TRL's metrics from packloss's (:data:`TRL_METRICS`), and packloss's as ``packloss/...``: one
        sum all-reduce and one gather (of the ``min``/``max`` metrics) over the ranks, one host read each."""
        members = plan.members[POLICY]  # every component trains on TRL's loss mask
        metrics, counts = result.metrics, result.counts  # [S] each: per_sequence_metrics
        rows = float(plan.num_seqs)
        sequence = self.importance_sampling_level == "sequence"  # TRL: one ratio per row, s_i = 1 if empty

        def summed(keys: tuple[str, ...]) -> tuple[Tensor, Tensor]:  # per sequence: values and counts
            full = [f"{POLICY}/{k}" for k in keys]
            return sum(metrics[k] for k in full), counts[full[0]]

        def token_mean(values: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
            return torch.where(count > 0, values * count, 0.0).sum(), count.sum()

        def row_mean(values: Tensor, count: Tensor, empty: float = 0.0) -> tuple[Tensor, Tensor]:
            total = torch.where(count > 0, values, empty).sum()
            return total, torch.full_like(total, rows)

        def extreme(values: Tensor, count: Tensor, lowest: bool, empty: float | None) -> tuple[Tensor, bool]:
            fill = (float("inf") if lowest else float("-inf")) if empty is None else empty
            values = torch.where(count > 0, values, fill)
            return (values.amin() if lowest else values.amax()), lowest

        entropy = torch.where(members, outputs.entropy.detach(), 0.0)
        means: dict[str, tuple[Tensor, Tensor]] = {"entropy": (entropy.sum(), members.sum(dtype=entropy.dtype))}
        extremes: dict[str, tuple[Tensor, bool]] = {}
        if self.beta != 0.0:
            key = "kl/ratio_weighted_kl" if "kl" in plan.components else f"{POLICY}/ref_kl_penalty"
            means["kl"] = token_mean(metrics[key], counts[key])
        for name, rule in TRL_METRICS.get(self._family(), {}).items():
            values, count = summed(rule.sources)
            if rule.reduce in ("min", "max"):
                empty = rule.empty_at_sequence_level if sequence else rule.empty
                extremes[name] = extreme(values, count, rule.reduce == "min", empty)
            elif rule.reduce == "rows" or (rule.reduce == "ratio" and sequence):
                means[name] = row_mean(values, count, rule.empty or 0.0)
            else:
                means[name] = token_mean(values, count)
        if self._entropy_bonus_enabled:  # TRL: the policy (and KL) loss of this rank, before its / G
            scale = self.accelerator.num_processes
            scale *= 1 if self.loss_type in _GENERATION_TOKEN_MEAN else self._accumulation(mode)
            policy = sum(term for name, term in result.terms.items() if name != "entropy").detach() * scale
            means["policy_loss"] = (policy, torch.ones_like(policy))  # averaged over the ranks
        for key in sorted(metrics):
            if key.endswith(("_min", "_max")):
                extremes[f"packloss/{key}"] = extreme(metrics[key], counts[key], key.endswith("_min"), None)
            else:
                means[f"packloss/{key}"] = token_mean(metrics[key], counts[key])

        pairs = torch.stack([torch.stack([s.to(torch.float64), c.to(torch.float64)]) for s, c in means.values()])
        totals = self.accelerator.reduce(pairs, reduction="sum")  # [K, 2]
        logged = dict(zip(means, (totals[:, 0] / totals[:, 1].clamp_min(1)).tolist(), strict=True))  # noqa: E501  # sync-ok: metric log
        if extremes:
            local = torch.stack([value.to(torch.float64) for value, _ in extremes.values()])  # [E]
            gathered = self.accelerator.gather(local).view(-1, len(extremes))  # [W, E]
            lowest = torch.tensor([low for _, low in extremes.values()], device=gathered.device)
            merged = torch.where(lowest, gathered.amin(0), gathered.amax(0))
            merged = torch.where(torch.isinf(merged), float("nan"), merged)  # no sequence with members
            logged.update(zip(extremes, merged.tolist(), strict=True))  # sync-ok: metric log
        for name, value in logged.items():
            self._metrics[mode][name].append(value)
        if self._entropy_bonus_enabled and mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
