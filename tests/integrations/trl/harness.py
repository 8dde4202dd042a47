"""The TRL test harness: padded GRPO batches, TRL 1.16's own loss code on them, and packloss's
recipe on the same data."""

from __future__ import annotations

import inspect
import math
import textwrap
import zlib
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer

from packloss import (
    Outputs,
    Plan,
    compute_loss,
    count_denominators,
)
from packloss.integrations.trl import LOSS_TYPES
from packloss.testing.trl import bare_grpo_trainer, padded_inputs, stub_forward, trl_config

F64 = torch.float64


RTOL = 1e-10


T = 9  # padded completion length (= max_completion_length)


# IS case → (vllm_importance_sampling_mode, clip_min, clip_max); "off": no vLLM correction (old stream
# given), "on_policy": no correction and no old stream (TRL then uses sg(per_token_logps))
IS_CASES = {
    "off": None,
    "on_policy": None,
    "token_truncate": ("token_truncate", 0.5, 3.0),
    "token_mask": ("token_mask", None, 2.0),
    "sequence_truncate": ("sequence_truncate", None, 3.0),
    "sequence_mask": ("sequence_mask", 0.5, 3.0),
}


BETAS = {"beta0": (0.0, True), "beta_kl": (0.04, False), "beta_kl_bias_corrected": (0.04, True)}


def config(
    loss_type: str, level: str, beta: str, is_case: str, rows: int, accumulation: int, **extra
) -> SimpleNamespace:
    """A duck-typed GRPOConfig: TRL 1.16's defaults with the case's options."""
    coef, bias_corrected = BETAS[beta]
    cfg = dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=coef,
        use_bias_correction_kl=bias_corrected,
        epsilon_high=1.5 if loss_type == "cispo" else 0.28,  # CISPO: an absolute cap
        max_completion_length=T,
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        use_vllm=IS_CASES[is_case] is not None,
    )
    if loss_type == "sapo":  # exact in float32: TRL builds its temperatures with torch.where(cond, float, float)
        cfg.update(sapo_temperature_pos=1.0, sapo_temperature_neg=1.25)
    if IS_CASES[is_case] is not None:
        mode, low, high = IS_CASES[is_case]
        cfg.update(
            vllm_importance_sampling_mode=mode,
            vllm_importance_sampling_clip_min=low,
            vllm_importance_sampling_clip_max=high,
        )
    cfg.update(extra)
    return trl_config(**cfg)


def _is_ratio_block() -> str:
    """The source of TRL's vLLM importance-sampling ratio (in ``_generate_and_score_completions``)."""
    src = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    anchor = src.index("per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask")
    start = src.rindex("if self.use_vllm and self.vllm_importance_sampling_correction:", 0, anchor)
    start = src.rindex("\n", 0, start) + 1
    end = src.index("# Compute the per-token log probabilities for the reference model", anchor)
    return textwrap.dedent(src[start : src.rindex("\n", 0, end) + 1])


IS_RATIO_BLOCK = _is_ratio_block()


def trl_is_ratio(trainer: GRPOTrainer, b: SimpleNamespace) -> torch.Tensor | None:
    """TRL's ``importance_sampling_ratio`` of the whole generation batch, by TRL's own code."""
    if not (trainer.use_vllm and trainer.vllm_importance_sampling_correction):
        return None
    scope = dict(
        self=trainer,
        torch=torch,
        math=math,
        old_per_token_logps=b.old,
        sampling_per_token_logps=b.sampling,
        completion_mask=b.completion_mask,
        tool_mask=b.tool_mask,
    )
    exec(IS_RATIO_BLOCK, scope)
    return scope["vllm_importance_sampling_ratio"]


def compute(
    trainer: GRPOTrainer,
    cfg: SimpleNamespace,
    b: SimpleNamespace,
    micro_batches: list[slice],
    old_given: bool = True,
    mode: str = "train",
) -> torch.Tensor:
    """Σ over the micro-batches of ``trainer._compute_loss`` on the batch ``b`` (what TRL backpropagates
    per step); ``trainer``: a bare TRL trainer or a subclass's (test_trl_trainer)."""
    trainer.model.training = mode == "train"
    ratio = trl_is_ratio(trainer, b)
    num_items = b.completion_mask.mul(b.tool_mask).sum()  # the generation batch's loss tokens
    total = torch.zeros((), dtype=F64)
    for rows in micro_batches:
        stub_forward(trainer, b.logps[rows], b.entropies[rows])
        streams = {}
        if old_given:
            streams["old_per_token_logps"] = b.old[rows]
        if cfg.use_vllm:
            streams["sampling_per_token_logps"] = b.sampling[rows]
        if ratio is not None:
            streams["importance_sampling_ratio"] = ratio[rows]
        if cfg.beta != 0:
            streams["ref_per_token_logps"] = b.ref[rows]
        inputs = padded_inputs(b.completion_mask[rows], b.tool_mask[rows], b.adv[rows], num_items, **streams)
        total = total + trainer._compute_loss(None, inputs)
    return total


def trl_loss(cfg: SimpleNamespace, b: SimpleNamespace, micro_batches: list[slice], old_given: bool = True):
    """TRL's own loss of the step: :func:`compute` on a bare ``GRPOTrainer``."""
    return compute(bare_grpo_trainer(GRPOTrainer, cfg), cfg, b, micro_batches, old_given)


def padded_batch(seed: int, rows: int, empty_rows: tuple[int, ...] = ()) -> SimpleNamespace:
    """TRL's padded layout: ``[R, T]`` float64 streams, completions of ragged length ``lens``, about
    15% of their tokens tool-masked, ``empty_rows`` without any loss token (truncated completions),
    padding holding arbitrary finite values, one advantage per row (one of them exactly 0)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, T + 1, (rows,), generator=g)
    lens[0] = T
    valid = torch.arange(T) < lens[:, None]  # [R, T]
    tool = torch.rand(rows, T, generator=g) < 0.85
    tool[:, 0] = True  # every row keeps a token unless it is empty
    truncated = torch.zeros(rows, dtype=torch.bool)
    truncated[list(empty_rows)] = True
    completion_mask = (valid & ~truncated[:, None]).long()
    tool_mask = torch.where(valid, tool, True).long()  # TRL pads the tool mask with 1
    p_old = torch.rand(rows, T, generator=g, dtype=F64) * 0.9 + 0.05
    old = p_old.log()
    logps = (p_old * torch.exp(0.45 * torch.randn(rows, T, generator=g, dtype=F64))).clamp(1e-4, 1).log()
    sampling = (p_old * torch.exp(0.25 * torch.randn(rows, T, generator=g, dtype=F64))).clamp(1e-4, 1).log()
    ref = (torch.rand(rows, T, generator=g, dtype=F64) * 0.9 + 0.05).log()
    adv = torch.randn(rows, generator=g, dtype=F64)
    adv[1] = 0.0
    return SimpleNamespace(
        lens=lens,
        valid=valid,
        completion_mask=completion_mask,
        tool_mask=tool_mask,
        logps=logps.requires_grad_(),
        old=old,
        sampling=sampling,
        ref=ref,
        adv=adv,
        entropies=torch.rand(rows, T, generator=g, dtype=F64) * 3,
    )


def packed(recipe, b: SimpleNamespace, rows: slice, old_given: bool = True) -> tuple[Plan, Outputs]:
    """The plan and outputs of the micro-batch ``rows``, each row's tokens concatenated."""
    valid = b.valid[rows]
    mask = (b.completion_mask[rows] * b.tool_mask[rows]).bool()[valid]
    adv = b.adv[rows][:, None].expand(-1, T)[valid]
    plan = Plan(
        b.lens[rows].tolist(),
        recipe.for_bin(mask),
        rollout_logprobs=b.sampling[rows][valid],
        old_logprobs=b.old[rows][valid] if old_given else None,
        ref_logprobs=b.ref[rows][valid],
        advantages=adv,
    )
    return plan, Outputs(logprobs=b.logps[rows][valid], entropy=b.entropies[rows][valid])


def packloss_loss(recipe, b, micro_batches: list[slice], old_given: bool = True, step: bool = True):
    """Σ over the micro-batches of ``compute_loss``, with the step's denominators (or each bin's own)."""
    bins = [packed(recipe, b, rows, old_given) for rows in micro_batches]
    denominators = count_denominators([p for p, _ in bins]) if step else None
    return sum(compute_loss(p, o, denominators).loss for p, o in bins)


def seed_of(*names: str) -> int:
    return zlib.crc32("/".join(names).encode())


def grad(loss, b) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, b.logps, retain_graph=True)
    return g


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL) -> None:
    scale = expected.abs().max().clamp_min(1e-300)
    err = (actual - expected).abs().max()
    assert err <= rtol * scale, f"max error {err.item():.3e} vs scale {scale.item():.3e}"


def assert_differ(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a - b).abs().max() > 1e-6 * b.abs().max(), "expected TRL and packloss to differ here"


def assert_differ_at(a: torch.Tensor, b: torch.Tensor, rtol: float) -> None:
    assert (a - b).abs().max() > rtol * b.abs().max(), "expected TRL and packloss to differ here"


def members_per_row(b: SimpleNamespace) -> torch.Tensor:
    return (b.completion_mask * b.tool_mask).sum(-1)


def cases(accepted_only: bool = False):
    """Every loss type × level × beta × vLLM case (``accepted_only``: without those TRL rejects)."""
    for loss_type in LOSS_TYPES:
        for level in ("token", "sequence"):
            for beta in BETAS:
                for is_case in IS_CASES:
                    if accepted_only and _vespo_rejects(loss_type, is_case):
                        continue
                    marks = []
                    case_id = f"{loss_type}-{level}-{beta}-{is_case}"
                    yield pytest.param(loss_type, level, beta, is_case, id=case_id, marks=marks)


def _vespo_rejects(loss_type: str, is_case: str) -> bool:
    """TRL rejects VESPO with a sequence-level vLLM correction (and so does from_trl)."""
    return loss_type == "vespo" and is_case.startswith("sequence_")


VARIANTS = {
    "delta_token": dict(loss_type="grpo", importance_sampling_level="token", delta=1.5),
    "delta_sequence": dict(loss_type="dapo", importance_sampling_level="sequence", delta=1.3),
    "delta_luspo_seq_tis": dict(loss_type="luspo", importance_sampling_level="sequence", delta=1.5,
                                use_vllm=True, vllm_importance_sampling_mode="token_truncate"),
    "cispo_default_cap": dict(loss_type="cispo", epsilon_high=None),  # TRL's cap = epsilon = 0.2
    "cispo_sequence_cap5": dict(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=5.0),
    "eps_asymmetric": dict(loss_type="bnpo", epsilon=0.1, epsilon_high=0.4, beta=0.1),
    "vespo_params": dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.0,
                         vespo_lambda_neg=1.0, use_vllm=True, vllm_importance_sampling_mode="token_mask",
                         vllm_importance_sampling_clip_min=0.4),
    "dr_grpo_entropy": dict(loss_type="dr_grpo", entropy_coef=0.01, beta=0.04),
    "is_cap_alias": dict(loss_type="dapo", use_vllm=True, vllm_importance_sampling_mode="token_truncate",
                         vllm_importance_sampling_cap=1.5, vllm_importance_sampling_clip_min=-1.0),
    "sequence_is_on_sequence_level": dict(loss_type="grpo", importance_sampling_level="sequence", use_vllm=True,
                                          vllm_importance_sampling_mode="sequence_truncate"),
    # off-policy sequence masking against vLLM's sampling log-probs, and (without vLLM) the old policy's
    "off_policy_mask_vllm": dict(loss_type="grpo", off_policy_mask_threshold=0.2, beta=0.04, use_vllm=True,
                                 vllm_importance_sampling_mode="token_truncate"),
    "off_policy_mask_old": dict(loss_type="dapo", off_policy_mask_threshold=-0.1),
}  # fmt: skip
