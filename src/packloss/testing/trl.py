"""TRL 1.16's ``GRPOTrainer._compute_loss`` without TRL's ``__init__`` (no model, no generation), and
a model's micro-batch as TRL's generation returns it (:func:`completion_batch`).

The tests in ``tests/integrations/test_trl*.py`` and ``packloss bench peers`` run TRL's own loss on a
padded batch they build; they share this one copy of what ``__init__`` would have set, so that a TRL
upgrade that reads one more attribute is fixed in one place. The head tests and ``packloss bench
trainers`` feed real trainers :func:`completion_batch`'s token ids. Imports neither ``trl`` nor a model:
the caller passes the ``GRPOTrainer`` class (the bench skips TRL when it cannot be imported).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from packloss.integrations.trl import TRL_DEFAULTS

__all__ = [
    "GRPO_FIELDS", "OneProcess", "trl_config", "bare_grpo_trainer", "stub_forward", "padded_inputs", "completion_batch",
]  # fmt: skip

GRPO_FIELDS = (
    "loss_type", "beta", "importance_sampling_level", "top_entropy_quantile", "off_policy_mask_threshold",
    "use_vllm", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "max_completion_length",
    "entropy_coef", "use_adaptive_entropy",
)  # fmt: skip  # what TRL 1.16's GRPOTrainer.__init__ copies from args and _compute_loss reads


class OneProcess:
    """TRL's accelerator on one process: gather and reduce are the identity. ``num_processes`` may be
    set on an instance to make a trainer believe it runs on more ranks (each then sees the same data)."""

    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x: Tensor) -> Tensor:
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x: Tensor, reduction: str = "sum") -> Tensor:
        return x


def trl_config(**fields: Any) -> SimpleNamespace:
    """A duck-typed ``GRPOConfig``: :data:`~packloss.integrations.trl.TRL_DEFAULTS` with ``fields``
    over them (a real ``GRPOConfig`` validates and resolves options a bare trainer does not need);
    ``steps_per_generation`` resolves to ``gradient_accumulation_steps``, as ``GRPOConfig`` does."""
    config = TRL_DEFAULTS | fields
    config.setdefault("steps_per_generation", config["gradient_accumulation_steps"])
    return SimpleNamespace(**config)


def bare_grpo_trainer(grpo_trainer: type, cfg: SimpleNamespace) -> Any:
    """A bare ``grpo_trainer`` (``GRPOTrainer`` or a subclass, made by ``object.__new__``) with the
    attributes ``_compute_loss`` reads, set as TRL 1.16's ``__init__`` sets them from ``args``
    (``epsilon_high`` falls back to ``epsilon`` there); one process, in training."""
    trainer = object.__new__(grpo_trainer)
    trainer.args = cfg
    for name in GRPO_FIELDS:
        setattr(trainer, name, getattr(cfg, name))
    trainer.epsilon_low = cfg.epsilon
    trainer.epsilon_high = cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
    trainer.aux_loss_enabled = False
    trainer._entropy_bonus_enabled = cfg.entropy_coef != 0.0 or cfg.use_adaptive_entropy
    trainer._last_world_entropy = float("inf")  # TRL's adaptive entropy control, before its first step
    trainer._entropy_window_stats = None
    trainer.current_gradient_accumulation_steps = cfg.gradient_accumulation_steps
    trainer.model = SimpleNamespace(training=True)
    trainer.accelerator = OneProcess()
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    return trainer


def stub_forward(trainer: Any, logps: Tensor, entropies: Tensor) -> None:
    """Make the trainer's forward return the given padded ``[R, T]`` log-probs and entropies, so that
    ``_compute_loss`` runs on them (and its gradient flows to ``logps``) without a model."""
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropies, None)


def padded_inputs(
    completion_mask: Tensor, tool_mask: Tensor, advantages: Tensor, num_items_in_batch: Tensor, **streams: Tensor
) -> dict[str, Tensor]:
    """The ``inputs`` of ``_compute_loss`` for ``[R, T]`` completions without prompts: empty prompts,
    zero completion ids (the stub forward ignores them), the masks, one advantage per row, then
    ``streams`` (e.g. ``old_per_token_logps``, ``ref_per_token_logps``) as given."""
    rows, width = completion_mask.shape
    return {
        "prompt_ids": torch.zeros(rows, 0, dtype=torch.long),
        "prompt_mask": torch.zeros(rows, 0, dtype=torch.long),
        "completion_ids": torch.zeros(rows, width, dtype=torch.long),
        "completion_mask": completion_mask,
        "tool_mask": tool_mask,
        "advantages": advantages,
        "num_items_in_batch": num_items_in_batch,
        **streams,
    }


def completion_batch(
    vocab: int, prompt_lens: Sequence[int], completion_lens: Sequence[int], seed: int = 0, pad_id: int = 0
) -> dict[str, Tensor]:
    """A micro-batch of ``_compute_loss``'s inputs with token ids, as TRL's generation returns it: prompts
    left-padded and completions right-padded with ``pad_id`` (masks 0 there), ids drawn from
    ``[1, vocab)``, one advantage per row and ``num_items_in_batch`` (the completion tokens)."""
    if len(prompt_lens) != len(completion_lens):
        raise ValueError(
            f"prompt_lens and completion_lens must have one length per row, got {prompt_lens}, {completion_lens}"
        )
    g = torch.Generator().manual_seed(seed)
    rows, width_p, width_c = len(prompt_lens), max(prompt_lens), max(completion_lens)
    prompt_mask = (torch.arange(width_p) >= width_p - torch.tensor(prompt_lens)[:, None]).long()  # [B, P]
    completion_mask = (torch.arange(width_c) < torch.tensor(completion_lens)[:, None]).long()  # [B, C]
    prompt_ids = torch.randint(1, vocab, (rows, width_p), generator=g).masked_fill(prompt_mask == 0, pad_id)
    completion_ids = torch.randint(1, vocab, (rows, width_c), generator=g).masked_fill(completion_mask == 0, pad_id)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(rows, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }
