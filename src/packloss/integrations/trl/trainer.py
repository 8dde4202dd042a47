"""TRL 1.16's ``GRPOTrainer`` with its loss computed by packloss: :class:`PacklossGRPOTrainer`.

Everything but the loss is TRL's: generation, rewards, advantages, the old / reference / vLLM log-probs,
the batch buffering, gradient accumulation and the logged rollout metrics. ``_compute_loss`` runs TRL's
own forward (``_get_per_token_logps_and_entropies``), packs TRL's padded ``[B, T]`` completion batch
into one bin with :class:`~packloss.PaddedLayout` (row ``b`` is sequence ``b``; a row without any
completion token, a masked truncated completion, keeps its first position as a non-member) and
computes the loss of ``from_trl(args)`` (:mod:`packloss.integrations.trl.config`) with
:func:`~packloss.compute_loss`::

    outputs.logprobs, outputs.entropy = per_token_logps, entropies        (the forward, packed)
    old_logprobs       = old_per_token_logps        (absent: on-policy, sg(trn), as TRL)
    inference_logprobs = sampling_per_token_logps   (vLLM's; NaN → old, i.e. ρ = 1, as TRL)
    ref_logprobs       = ref_per_token_logps
    advantages         = advantages                 ([B] broadcast to the tokens, or [B, T])
    members            = completion_mask · tool_mask

TRL 1.16's GRPO trainer has no padding-free mode; the packing above is the whole layout. Reading the
``B`` row lengths for the layout is one device→host read per micro-batch.

Normalisation (``packloss_normalization``; the ``G`` micro-batches of an optimizer step on ``W``
ranks). packloss's loss is a rank's share of the step's loss with gradients summed over ranks;
accelerate's DDP averages them, so the trainer returns ``W ×`` packloss's loss.

* ``"trl"`` (default): TRL's denominators, as step denominators built from TRL's batch, so loss and
  gradient equal TRL's for every loss type: ``dapo``/``cispo``/``vespo``: ``num_items_in_batch · G /
  steps_per_generation`` (TRL's generation-wide token count scaled to a step); ``grpo``/``sapo``: the
  step's rows ``B · G · W`` (rows without a loss token included); ``bnpo`` and the entropy bonus: this
  micro-batch's member tokens ``· G · W`` (TRL's per-micro-batch mean); ``dr_grpo``/``luspo``: the
  constant of ``from_trl`` with this micro-batch's rows.
* ``"step"``: packloss's: :func:`~packloss.count_denominators` over the ``G`` micro-batches of each
  optimizer step (one all-reduce over the ranks when ``W > 1``), counted when TRL generates (the
  step's micro-batches are then buffered; needs ``steps_per_generation`` a multiple of ``G``). It
  equals ``"trl"`` for ``dapo``/``cispo``/``vespo`` when ``steps_per_generation == G`` and for
  ``grpo``/``sapo`` when every row has a loss token; ``bnpo`` and the entropy bonus become token means
  over the step (``bnpo`` is then ``dapo``).

Evaluation normalises as TRL in both modes (one batch, no accumulation).

Metrics: TRL's names where packloss's metrics correspond, merged over the ranks as TRL does —
``entropy``; ``kl`` (``beta != 0``: mean ``ρ·k3``, or ``k3`` without ``use_bias_correction_kl``);
``clip_ratio/low_mean``, ``/high_mean``, ``/region_mean``, ``/low_min``, ``/high_max`` (the PPO
family: ``pg/clip_frac_low``, ``pg/clip_frac_high``); ``cispo_clip_ratio``; ``vespo/phi_seq_mean``;
``policy_loss`` and ``entropy_coef`` (with an entropy bonus); ``aux_loss`` (MoE) — and every packloss
metric as ``packloss/{component}/{metric}`` (member-weighted over the ranks; ``*_min``/``*_max`` by
min/max). TRL's ratio metrics are per sequence at ``importance_sampling_level="sequence"`` and for
VESPO's ``φ``: means over the rows, a row without a loss token included with its value (ratio 1:
unclipped, ``φ = 1``), as TRL.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor
from trl import GRPOTrainer

from packloss.core.bin import Component, Normalize, Outputs, Plan
from packloss.core.engine import LossResult, compute_loss
from packloss.core.entropy import Entropy
from packloss.core.layout import PaddedLayout
from packloss.core.recipe import Recipe
from packloss.core.step import StepDenominators, count_denominators
from packloss.integrations.trl.config import from_trl

__all__ = ["PacklossGRPOTrainer", "NORMALIZATIONS"]

NORMALIZATIONS = ("trl", "step")
"""The values of ``PacklossGRPOTrainer(packloss_normalization=...)`` (module doc)."""

_FORWARD_KWARGS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)  # the batch entries TRL's forward takes besides the ids and the mask (multimodal models)
_PPO_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
_GENERATION_TOKEN_MEAN = ("dapo", "cispo", "vespo")  # TRL divides by num_items_in_batch


def _check_normalization(config: Any, normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(
            f"PacklossGRPOTrainer.packloss_normalization must be one of {NORMALIZATIONS}, got {normalization!r}"
        )
    if normalization == "step" and config.steps_per_generation % config.gradient_accumulation_steps:
        raise ValueError(
            "PacklossGRPOTrainer.packloss_normalization='step' needs GRPOConfig.steps_per_generation "
            f"({config.steps_per_generation}) to be a multiple of gradient_accumulation_steps "
            f"({config.gradient_accumulation_steps}): a step's micro-batches must come from one generation"
        )


class PacklossGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` whose loss is packloss's ``from_trl(args)`` recipe (module doc).

    Takes ``GRPOTrainer``'s arguments and ``packloss_normalization`` (``"trl"``, default, or
    ``"step"``). Options ``from_trl`` does not map raise ``NotImplementedError`` before any model
    loads. Attributes: ``packloss_recipe`` (the :class:`~packloss.Recipe`), ``packloss_normalization``.
    """

    def __init__(self, *args: Any, packloss_normalization: str = "trl", **kwargs: Any) -> None:
        config = inspect.signature(GRPOTrainer.__init__).bind(None, *args, **kwargs).arguments.get("args")
        if config is not None:  # fail before the models load
            from_trl(config)
            _check_normalization(config, packloss_normalization)
        super().__init__(*args, **kwargs)
        self._init_packloss(packloss_normalization)

    def _init_packloss(self, normalization: str) -> None:
        """The recipe and the normalisation mode, from ``self.args`` (``GRPOTrainer.__init__`` has run)."""
        _check_normalization(self.args, normalization)
        self.packloss_normalization = normalization
        self.packloss_recipe: Recipe = from_trl(self.args, num_processes=self.accelerator.num_processes)
        self._packloss_windows: list[StepDenominators] = []

    # -----------------------------------------------------------------------------------------------
    # TRL's batch → a packloss bin
    # -----------------------------------------------------------------------------------------------

    def _accumulation(self, mode: str) -> int:
        return self.current_gradient_accumulation_steps if mode == "train" else 1

    def _trl_rules(self, mode: str) -> bool:
        return self.packloss_normalization == "trl" or mode == "eval"

    def _components(self, members: Tensor, rows: int, mode: str) -> dict[str, Component]:
        components = {}
        for name, part in self.packloss_recipe.parts.items():
            constant = part.constant
            if constant is not None and self._trl_rules(mode):
                # from_trl's constant counts the configured rows and accumulation; TRL counts this call's
                configured = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
                constant = constant * rows * self._accumulation(mode) / configured
            components[name] = Component(part.loss, members, None, part.normalize, constant)
        return components

    def _packloss_plan(self, inputs: dict[str, Any], mode: str) -> tuple[Plan, PaddedLayout]:
        """The plan of TRL's micro-batch ``inputs`` and the layout that packs its ``[B, T]`` tensors."""
        completion_mask = inputs["completion_mask"]  # [B, T]
        loss_mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        rows, width = completion_mask.shape
        # every row is a sequence: one without a completion token keeps its first position (a non-member)
        first = torch.arange(width, device=completion_mask.device) == 0  # [T]
        layout = PaddedLayout.from_attention_mask(completion_mask.bool() | first)  # reads the B row lengths

        def packed(name: str, value: Tensor | None) -> Tensor | None:
            return None if value is None else layout.pack(value, name)

        advantages = inputs["advantages"]
        if advantages.dim() == 1:  # one per completion (TRL); [B, T] from subclasses
            advantages = advantages[:, None].expand(rows, width)
        old = inputs.get("old_per_token_logps")
        sampling = inputs.get("sampling_per_token_logps")
        if sampling is not None and old is not None:
            sampling = torch.where(torch.isnan(sampling), old, sampling)  # vLLM gave no log-prob: ρ = 1, as TRL
        plan = Plan(
            layout.seq_lens,
            self._components(layout.pack(loss_mask.bool(), "completion_mask"), rows, mode),
            inference_logprobs=packed("sampling_per_token_logps", sampling),
            old_logprobs=packed("old_per_token_logps", old),
            ref_logprobs=packed("ref_per_token_logps", inputs.get("ref_per_token_logps")),
            advantages=packed("advantages", advantages),
        )
        return plan, layout

    def _trl_denominators(self, plan: Plan, inputs: dict[str, Any], mode: str) -> StepDenominators:
        """TRL's normalisers of this call as step counts (module doc, ``"trl"``)."""
        accumulation, world = self._accumulation(mode), self.accelerator.num_processes
        per_generation = self.args.steps_per_generation if mode == "train" else 1
        counts = {}
        for name, comp in plan.components.items():
            members = plan.members[name]
            if comp.normalize is Normalize.CONSTANT:
                count = members.new_zeros(0, dtype=torch.float64)
            elif comp.normalize is Normalize.SEQUENCE_MEAN:
                rows = float(plan.num_seqs * accumulation * world)
                count = torch.full((1,), rows, dtype=torch.float64, device=members.device)
            elif self.loss_type in _GENERATION_TOKEN_MEAN and not isinstance(comp.loss, Entropy):
                items = inputs["num_items_in_batch"].to(members.device, torch.float64).reshape(1)
                count = items * (accumulation / per_generation)
            else:  # bnpo and the entropy bonus: this micro-batch's token mean, / G
                count = members.sum(dtype=torch.float64).reshape(1) * (accumulation * world)
            counts[name] = count
        modes = {name: comp.mode for name, comp in plan.components.items()}
        return StepDenominators(modes=modes, counts=counts, num_groups=0)

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
        plan, layout = self._packloss_plan(inputs, mode)
        outputs = Outputs(logprobs=layout.pack(per_token_logps, "per_token_logps"), entropy=layout.pack(entropies))
        result = compute_loss(plan, outputs, self._denominators(plan, inputs, mode), per_sequence_metrics=True)
        # packloss: this rank's share of the step's loss, summed over ranks; accelerate's DDP averages
        loss = result.loss * self.accelerator.num_processes
        if self.aux_loss_enabled:  # the MoE load-balancing loss, as TRL adds it
            loss = loss + self.router_aux_loss_coef * aux_loss / self._accumulation(mode)
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())  # noqa: E501  # sync-ok: TRL logging
        self._log_packloss_metrics(result, plan, outputs, mode)
        return loss

    # -----------------------------------------------------------------------------------------------
    # Metrics
    # -----------------------------------------------------------------------------------------------

    def _log_packloss_metrics(self, result: LossResult, plan: Plan, outputs: Outputs, mode: str) -> None:
        """TRL's metrics from packloss's, and packloss's as ``packloss/...`` (module doc): one sum
        all-reduce and one gather (of the ``min``/``max`` metrics) over the ranks, one host read each."""
        members = next(iter(plan.members.values()))  # every part trains on TRL's loss mask
        metrics, counts = result.metrics, result.counts  # [S] each: per_sequence_metrics
        rows = float(plan.num_seqs)

        def token_mean(key: str) -> tuple[Tensor, Tensor]:
            has = counts[key] > 0
            return torch.where(has, metrics[key] * counts[key], 0.0).sum(), counts[key].sum()

        def row_mean(key: str, empty: float = 0.0) -> tuple[Tensor, Tensor]:
            """TRL's mean of a per-sequence value over the rows; ``empty``: TRL's value for a row without
            a loss token."""
            total = torch.where(counts[key] > 0, metrics[key], empty).sum()
            return total, torch.full_like(total, rows)

        def extreme(key: str, lowest: bool, empty: float | None = None) -> tuple[Tensor, bool]:
            """The min / max over the sequences with members (and ``empty`` for a row without)."""
            fill = (float("inf") if lowest else float("-inf")) if empty is None else empty
            values = torch.where(counts[key] > 0, metrics[key], fill)
            return (values.amin() if lowest else values.amax()), lowest

        entropy = torch.where(members, outputs.entropy.detach(), 0.0)
        means: dict[str, tuple[Tensor, Tensor]] = {"entropy": (entropy.sum(), members.sum(dtype=entropy.dtype))}
        extremes: dict[str, tuple[Tensor, bool]] = {}
        if self.beta != 0.0:
            means["kl"] = token_mean("kl/ratio_weighted_kl" if "kl" in plan.components else "pg/ref_kl_penalty")
        sequence = self.importance_sampling_level == "sequence"  # TRL: one ratio per row, s_i = 1 if empty
        ratio_mean = row_mean if sequence else token_mean
        if self.loss_type in _PPO_FAMILY:
            low, high = ratio_mean("pg/clip_frac_low"), ratio_mean("pg/clip_frac_high")
            means["clip_ratio/low_mean"], means["clip_ratio/high_mean"] = low, high
            means["clip_ratio/region_mean"] = (low[0] + high[0], low[1])  # disjoint: A < 0 and A > 0
            empty = 0.0 if sequence else None  # unclipped; at token level TRL's row mean is NaN there
            extremes["clip_ratio/low_min"] = extreme("pg/clip_frac_low", lowest=True, empty=empty)
            extremes["clip_ratio/high_max"] = extreme("pg/clip_frac_high", lowest=False, empty=empty)
        elif self.loss_type == "cispo":
            means["cispo_clip_ratio"] = ratio_mean("pg/clip_frac_high")
        elif self.loss_type == "vespo":
            means["vespo/phi_seq_mean"] = row_mean("pg/phi", empty=1.0)  # an empty row's w is 1: φ(1) = 1
        if self._entropy_bonus_enabled:  # TRL: the policy (and KL) loss of this rank, before its / G
            scale = self.accelerator.num_processes
            scale *= 1 if self.loss_type in _GENERATION_TOKEN_MEAN else self._accumulation(mode)
            policy = sum(term for name, term in result.terms.items() if name != "entropy").detach() * scale
            means["policy_loss"] = (policy, torch.ones_like(policy))  # averaged over the ranks
        for key in sorted(metrics):
            if key.endswith(("_min", "_max")):
                extremes[f"packloss/{key}"] = extreme(key, lowest=key.endswith("_min"))
            else:
                means[f"packloss/{key}"] = token_mean(key)

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
