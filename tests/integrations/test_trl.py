"""packloss.integrations.trl: ``from_trl(GRPOConfig)`` against TRL 1.16's own code.

TRL's side runs ``GRPOTrainer._compute_loss`` on a bare trainer (:mod:`packloss.testing.trl`:
``object.__new__``, the attributes ``__init__`` copies from the config, a stub forward returning the
given per-token log-probs) and its vLLM importance-sampling ratio is computed by the block of
``_generate_and_score_completions`` that computes it (read with ``inspect`` and run as is). Data:
random float64 in TRL's padded ``[R, T]`` layout with ragged completions, tool-masked tokens and rows
without any loss token. packloss's side packs each row's tokens (``seq_lens`` = completion lengths)
and runs ``compute_loss``. Loss and gradient w.r.t. the per-token log-probs agree within 1e-10
relative (to the largest magnitude of TRL's value); where TRL normalises differently the exact
relation is asserted, and that they differ.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import textwrap
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from trl import GRPOConfig, GRPOTrainer

from conftest import bin_of, check_against_paper, packings, poison_non_members, with_old
from packloss import (
    TRUST_REGIONS,
    Outputs,
    Plan,
    PolicyGradient,
    RolloutCorrection,
    compute_loss,
    count_denominators,
)
from packloss.core.trust_regions import GSPO, PPOClip
from packloss.integrations.trl import (
    IS_MODES,
    LOSS_TYPES,
    TRL_DEFAULTS,
    VESPO,
    CISPOCap,
    RatioWeightedKL,
    SequenceLevel,
    from_trl,
    mapping_rows,
    mapping_table,
)
from packloss.testing import OpCounter
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


# ---------------------------------------------------------------------------------------------------
# TRL's side
# ---------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------
# The data and packloss's side
# ---------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------
# The grid: every loss type × level × beta × vLLM correction
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type, level, beta, is_case", list(cases()))
def test_one_micro_batch_matches_trl(loss_type, level, beta, is_case):
    """One micro-batch of 7 rows, two of them without a loss token: equal loss and gradient; for
    ``grpo``/``sapo`` TRL's mean over rows counts the empty rows: TRL = packloss · 5/7, asserted."""
    cfg = config(loss_type, level, beta, is_case, rows=7, accumulation=1)
    if _vespo_rejects(loss_type, is_case):
        with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
            from_trl(cfg)
        return
    b = padded_batch(seed=seed_of(loss_type, level, beta, is_case), rows=7, empty_rows=(2, 5))
    old_given = is_case != "on_policy"
    everything = [slice(0, 7)]
    trl = trl_loss(cfg, b, everything, old_given)
    ours = packloss_loss(from_trl(cfg), b, everything, old_given)
    if loss_type in ("grpo", "sapo"):
        factor = (members_per_row(b) > 0).sum().to(F64) / 7  # rows with members / rows
        assert factor < 1
        assert_differ(ours, trl)
        ours = ours * factor
    assert_close(ours, trl)
    assert_close(grad(ours, b), grad(trl, b))


@pytest.mark.parametrize("loss_type, level, beta, is_case", list(cases(accepted_only=True)))
def test_gradient_accumulation_matches_trl(loss_type, level, beta, is_case):
    """A step of 3 micro-batches of 4 rows (``num_items_in_batch`` over the step, as TRL with
    ``steps_per_generation == gradient_accumulation_steps``): packloss with the step's denominators
    equals TRL's sum over its micro-batch calls; ``bnpo``'s per-micro-batch mean equals packloss's
    per-bin normalisation / G and differs from the step's."""
    cfg = config(loss_type, level, beta, is_case, rows=4, accumulation=3)
    b = padded_batch(seed=seed_of(loss_type, level, beta, is_case, "ga"), rows=12)
    old_given = is_case != "on_policy"
    micro = [slice(0, 4), slice(4, 8), slice(8, 12)]
    trl = trl_loss(cfg, b, micro, old_given)
    recipe = from_trl(cfg)
    ours = packloss_loss(recipe, b, micro, old_given)
    if loss_type == "bnpo":
        assert len({int(members_per_row(b)[m].sum()) for m in micro}) > 1  # unequal micro-batch token counts
        assert_differ(ours, trl)
        ours = packloss_loss(recipe, b, micro, old_given, step=False) / 3
    assert_close(ours, trl)
    assert_close(grad(ours, b), grad(trl, b))


# ---------------------------------------------------------------------------------------------------
# Options beyond the grid
# ---------------------------------------------------------------------------------------------------


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
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_option_variants_match_trl(name):
    """``delta`` (= dual clip), CISPO's absolute cap (unset: ``epsilon``), asymmetric clip with KL,
    VESPO's parameters with a token mask, the entropy bonus, the deprecated cap alias and a clip_min
    <= 0, a sequence-level correction on sequence ratios: one micro-batch, no empty rows."""
    cfg = config("dapo", "token", "beta0", "off", rows=6, accumulation=1)
    for key, value in VARIANTS[name].items():
        setattr(cfg, key, value)
    if cfg.vllm_importance_sampling_cap is not None:  # what GRPOConfig.__post_init__ does with the alias
        cfg.vllm_importance_sampling_clip_max = cfg.vllm_importance_sampling_cap
    b = padded_batch(seed=len(name), rows=6)
    trl = trl_loss(cfg, b, [slice(0, 6)])
    ours = packloss_loss(from_trl(cfg), b, [slice(0, 6)])
    assert_close(ours, trl)
    assert_close(grad(ours, b), grad(trl, b))


def test_entropy_bonus_is_a_per_micro_batch_mean_in_trl():
    """TRL's entropy bonus is a token mean per micro-batch / G (as bnpo): packloss's step mean differs
    with unequal micro-batch token counts; per-bin normalisation / G equals it."""
    cfg = config("dapo", "token", "beta0", "off", rows=4, accumulation=2, entropy_coef=0.05)
    b = padded_batch(seed=11, rows=8)
    micro = [slice(0, 4), slice(4, 8)]
    trl = trl_loss(cfg, b, micro)
    recipe = from_trl(cfg)
    assert set(recipe.components) == {"pg", "entropy"}
    bins = [packed(recipe, b, m) for m in micro]
    step = count_denominators([p for p, _ in bins])
    pg = sum(compute_loss(p, o, step).terms["pg"] for p, o in bins)
    entropy_local = sum(compute_loss(p, o).terms["entropy"] for p, o in bins) / 2
    entropy_step = sum(compute_loss(p, o, step).terms["entropy"] for p, o in bins)
    assert_close(pg + entropy_local, trl)
    assert_differ(pg + entropy_step, trl)


def test_dapo_denominator_when_generation_spans_two_steps():
    """``steps_per_generation = 2·G``: TRL divides by the generation's tokens · G/spg (its average per
    step), packloss by the step's own count: TRL = packloss · step tokens / (generation tokens / 2)."""
    cfg = config("dapo", "token", "beta0", "off", rows=4, accumulation=2, steps_per_generation=4)
    b = padded_batch(seed=12, rows=16)  # the generation batch: 4 micro-batches, 2 optimizer steps
    first_step = [slice(0, 4), slice(4, 8)]
    trl = trl_loss(cfg, b, first_step)
    ours = packloss_loss(from_trl(cfg), b, first_step)
    step_tokens, generation_tokens = members_per_row(b)[:8].sum(), members_per_row(b).sum()
    assert step_tokens * 2 != generation_tokens
    assert_differ(ours, trl)
    assert_close(ours * step_tokens / (generation_tokens / 2), trl)


def test_sapo_temperatures_are_float32_in_trl():
    """TRL's SAPO temperatures are ``torch.where(A > 0, τ_pos, τ_neg)`` of two Python floats: float32,
    whatever the data's dtype. With TRL's default ``τ_neg = 1.05`` (not a float32 number) a float64
    loss differs from packloss's (float64 τ) at ~1e-8 relative; with float32-exact τ they agree."""
    cfg = config("sapo", "token", "beta0", "off", rows=6, accumulation=1, sapo_temperature_neg=1.05)
    b = padded_batch(seed=14, rows=6)
    trl = trl_loss(cfg, b, [slice(0, 6)])
    ours = packloss_loss(from_trl(cfg), b, [slice(0, 6)])
    assert_differ_at(ours, trl, 1e-11)
    assert_close(ours, trl, rtol=1e-6)
    assert_close(grad(ours, b), grad(trl, b), rtol=1e-6)


def test_nan_sampling_logprob_is_ratio_one_in_trl_not_in_packloss():
    """TRL turns a NaN vLLM log-prob (a token vLLM could not score) into ρ = 1; packloss reads the
    inference stream as given, so its loss is NaN (the caller must fill it)."""
    cfg = config("dapo", "token", "beta0", "token_truncate", rows=4, accumulation=1)
    b = padded_batch(seed=13, rows=4)
    b.sampling[0, 0] = float("nan")
    trl = trl_loss(cfg, b, [slice(0, 4)])
    ours = packloss_loss(from_trl(cfg), b, [slice(0, 4)])
    assert torch.isfinite(trl) and torch.isnan(ours)


def test_trl_defaults_match_grpo_config():
    """:data:`TRL_DEFAULTS` are ``GRPOConfig``'s dataclass defaults, and a real config maps."""
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for name, value in TRL_DEFAULTS.items():
        assert defaults[name] == value, name
    real = GRPOConfig(output_dir="/tmp/packloss-trl-test", use_cpu=True, bf16=False, num_generations=2,
                      per_device_train_batch_size=2, report_to=[])  # fmt: skip
    recipe = from_trl(real)
    assert set(recipe.components) == {"pg"}
    assert recipe.components["pg"].normalize.value == "token"  # dapo, TRL 1.16's default
    pg = recipe.objective
    assert pg.trust_region == PPOClip(0.2, 0.2) and pg.correction is None and pg.penalties == ()
    gspo = copy.copy(real)
    gspo.loss_type, gspo.importance_sampling_level = "grpo", "sequence"
    recipe = from_trl(gspo)
    assert recipe.objective.trust_region == GSPO(0.2, 0.2)


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(top_entropy_quantile=0.2), NotImplementedError, "GRPOConfig.top_entropy_quantile=0.2 is not mapped"),
        (dict(off_policy_mask_threshold=0.5), NotImplementedError, "off_policy_mask_threshold"),
        (dict(use_adaptive_entropy=True), NotImplementedError, "use_adaptive_entropy"),
        (dict(use_vllm=True, vllm_importance_sampling_clip_max=None), NotImplementedError, "clip_max=None"),
        (dict(delta=1.1, epsilon_high=0.28), NotImplementedError, "GRPOConfig.delta=1.1"),
        (dict(loss_type="vespo", use_vllm=True, vllm_importance_sampling_mode="token_mask",
              vllm_importance_sampling_clip_min=1.5), NotImplementedError, "vllm_importance_sampling_clip_min/max"),
        (dict(loss_type="vespo", use_vllm=True), ValueError, "'token_truncate' or 'token_mask'"),
        (dict(loss_type="ppo"), ValueError, "GRPOConfig.loss_type must be one of"),
        (dict(importance_sampling_level="group"), ValueError, "GRPOConfig.importance_sampling_level"),
        (dict(epsilon=float("nan")), ValueError, "GRPOConfig.epsilon must be finite"),
        (dict(beta=-0.1), ValueError, "GRPOConfig.beta must be >= 0"),
        (dict(use_vllm="yes"), TypeError, "GRPOConfig.use_vllm must be a bool"),
        (dict(loss_type="dr_grpo", max_completion_length=None), ValueError, "max_completion_length"),
        (dict(use_vllm=True, vllm_importance_sampling_clip_min=4.0), ValueError, "clip_min"),
        (dict(vllm_importance_sampling_mode="bogus", use_vllm=True), ValueError, "vllm_importance_sampling_mode"),
    ],
)  # fmt: skip
def test_unmapped_and_bad_options_raise(options, error, match):
    cfg = SimpleNamespace(**{**TRL_DEFAULTS, **options})
    with pytest.raises(error, match=match):
        from_trl(cfg)


def test_missing_fields_take_trl_defaults_and_num_processes_scales_constants():
    recipe = from_trl(SimpleNamespace(loss_type="dr_grpo", gradient_accumulation_steps=2), num_processes=4)
    assert recipe.components["pg"].constant == 8 * 512 * 2 * 4  # B · max_completion_length · G · W
    assert from_trl(SimpleNamespace(loss_type="luspo")).components["pg"].constant == 8
    with pytest.raises(ValueError, match="num_processes must be a positive int"):
        from_trl(SimpleNamespace(), num_processes=0)
    with pytest.raises(TypeError, match="needs a GRPOConfig"):
        from_trl(None)


# ---------------------------------------------------------------------------------------------------
# The regions and the KL part defined in the module: paper references, NaN safety, no syncs
# ---------------------------------------------------------------------------------------------------


def _f64(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)  # torch.where(cond, float, float) would round to float32


def _vespo_reference(seq, region: VESPO):
    """VESPO (arXiv:2602.10693): φ(w) = e^λ · w^k · e^(−λw) of the sequence weight, as TRL clamps it."""
    log_w = (seq.trn - seq.old).detach().clamp(-20, 20).sum()
    c = region.correction
    if c is not None:  # token-level rollout weights folded into w (TRL's vespo)
        rho = torch.exp(seq.old - seq.inf)
        if c.mode == "truncate":
            weight = rho.clamp(min=c.low, max=c.high)
        else:
            weight = torch.where((rho <= c.high) & (rho >= (c.low or 0.0)), rho, 0.0)
        log_w = log_w + torch.log(weight).clamp(math.log(1e-8), 20).sum()
    w = log_w.clamp(math.log(1e-8), 20).exp()
    pos = seq.adv >= 0
    k = torch.where(pos, _f64(region.k_pos), _f64(region.k_neg))
    lam = torch.where(pos, _f64(region.lambda_pos), _f64(region.lambda_neg))
    phi = torch.exp(lam) * w**k * torch.exp(-lam * w)
    return -(phi * seq.adv * seq.trn * seq.w).sum()


def _sequence_reference(seq, inner):
    """GSPO's sequence-level objective: the inner region on s = exp(mean log r), differentiable."""
    s = torch.exp((seq.trn - seq.old).mean()).expand_as(seq.trn)
    if isinstance(inner, PPOClip):
        objective = torch.min(s * seq.adv, s.clamp(1 - inner.clip_low, 1 + inner.clip_high) * seq.adv)
        if inner.dual_clip_c is not None:
            objective = torch.where(seq.adv < 0, torch.max(objective, inner.dual_clip_c * seq.adv), objective)
    elif isinstance(inner, CISPOCap):
        objective = s.clamp(max=inner.cap).detach() * seq.adv * seq.trn
    else:  # SAPO: (4/τ) σ(τ (s − 1)) A
        tau = torch.where(seq.adv > 0, _f64(inner.tau_pos), _f64(inner.tau_neg))
        objective = 4 / tau * torch.sigmoid(tau * (s - 1)) * seq.adv
    return -(objective * seq.w).sum()


def _kl_reference(seq, coef: float, level: str):
    log_r = seq.trn - seq.old
    rho = torch.exp(log_r.mean() if level == "sequence" else log_r)
    x = seq.ref - seq.trn
    return (coef * rho * (x.exp() - x - 1) * seq.w).sum()


def _sapo_regions():
    return [TRUST_REGIONS["sapo"](1.0, 1.05)]


REGIONS = {
    "cispo_cap": (CISPOCap(1.3), lambda seq: -(torch.exp(seq.trn - seq.old).clamp(max=1.3).detach() * seq.adv
                                                * seq.trn * seq.w).sum()),
    "vespo": (VESPO(), lambda seq: _vespo_reference(seq, VESPO())),
    "vespo_tis": (VESPO(correction=RolloutCorrection(mode="truncate", high=2.0, low=0.5)),
                  lambda seq: _vespo_reference(seq, VESPO(correction=RolloutCorrection(mode="truncate", high=2.0,
                                                                                      low=0.5)))),
    "vespo_mis": (VESPO(1.5, 2.5, 2.0, 1.0, RolloutCorrection(mode="mask", high=1.5)),
                  lambda seq: _vespo_reference(seq, VESPO(1.5, 2.5, 2.0, 1.0, RolloutCorrection(mode="mask",
                                                                                                high=1.5)))),
    "sequence_ppo": (SequenceLevel(PPOClip(0.2, 0.28)), lambda seq: _sequence_reference(seq, PPOClip(0.2, 0.28))),
    "sequence_dual": (SequenceLevel(PPOClip(0.2, 0.28, 1.4)),
                      lambda seq: _sequence_reference(seq, PPOClip(0.2, 0.28, 1.4))),
    "sequence_cispo": (SequenceLevel(CISPOCap(1.1)), lambda seq: _sequence_reference(seq, CISPOCap(1.1))),
    **{f"sequence_{r.name}": (SequenceLevel(r), lambda seq, r=r: _sequence_reference(seq, r)) for r in _sapo_regions()},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REGIONS))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=packings())
def test_region_matches_paper_reference(name, case):
    region, paper = REGIONS[name]
    check_against_paper(PolicyGradient(region), paper, case, with_old=True, rtol=1e-9)


@pytest.mark.parametrize("level", ["token", "sequence"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=packings())
def test_ratio_weighted_kl_matches_reference(level, case):
    check_against_paper(RatioWeightedKL(0.3, level), lambda seq: _kl_reference(seq, 0.3, level), case,
                        with_old=True, rtol=1e-9)  # fmt: skip


def _module_objectives():
    out = {f"pg_{k}": (PolicyGradient(region), RatioWeightedKL(0.04)) for k, (region, _) in REGIONS.items()}
    out["kl_sequence"] = (PolicyGradient(SequenceLevel()), RatioWeightedKL(0.04, "sequence"))
    return out


@pytest.mark.parametrize("name", sorted(_module_objectives()))
def test_module_parts_are_nan_safe(name):
    rl, kl = _module_objectives()[name]
    clean = with_old(bin_of("sdft", seed=2))
    poisoned, _, _ = poison_non_members(clean)
    out_clean = compute_loss(clean.plan(rl, kl), clean.outputs())
    out_poisoned = compute_loss(poisoned.plan(rl, kl), poisoned.outputs())
    (g_clean,) = torch.autograd.grad(out_clean.loss, clean.trainer_logprobs)
    (g_poisoned,) = torch.autograd.grad(out_poisoned.loss, poisoned.trainer_logprobs)
    assert torch.isfinite(out_poisoned.loss) and torch.isfinite(g_poisoned).all()
    assert torch.equal(out_clean.loss, out_poisoned.loss) and torch.equal(g_clean, g_poisoned)
    for key, value in out_clean.metrics.items():
        assert torch.equal(value, out_poisoned.metrics[key]), key


@pytest.mark.parametrize("name", sorted(_module_objectives()))
@pytest.mark.parametrize("mode", ["token", "sequence_mean", "constant"])
def test_module_parts_sync_free_and_flat(name, mode):
    rl, kl = _module_objectives()[name]
    totals = set()
    for num_seqs in (1, 16, 256):
        streams = with_old(bin_of("sdft", num_tokens=1024, num_seqs=num_seqs, seed=3))
        constants = {"rl": 1000.0, "ref_kl": 10.0} if mode == "constant" else None
        plan = streams.plan(rl, kl, normalize=mode, constants=constants)
        with OpCounter() as counter:
            compute_loss(plan, streams.outputs(), per_sequence_metrics=True).loss.backward()
        assert counter.num_syncs == 0, counter.syncs
        totals.add(counter.total)
    assert len(totals) == 1, totals


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: CISPOCap(0.0), ValueError, "CISPOCap.cap must be > 0"),
        (lambda: CISPOCap(float("inf")), ValueError, "CISPOCap.cap must be finite"),
        (lambda: VESPO(k_pos=float("nan")), ValueError, "VESPO.k_pos must be finite"),
        (lambda: VESPO(correction=RolloutCorrection(level="sequence")), ValueError, "token-level"),
        (lambda: VESPO(correction=0.5), TypeError, "VESPO.correction must be a RolloutCorrection"),
        (lambda: SequenceLevel(SequenceLevel()), TypeError, "token-level TrustRegion"),
        (lambda: RatioWeightedKL(-1.0), ValueError, "RatioWeightedKL.coef must be >= 0"),
        (lambda: RatioWeightedKL(0.1, "row"), ValueError, "RatioWeightedKL.level"),
    ],
)
def test_module_part_validation(build, error, match):
    with pytest.raises(error, match=match):
        build()


# ---------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------


def test_mapping_rows_cover_every_loss_type_and_docs_hold_the_table():
    rows = mapping_rows()
    assert [r.loss_type for r in rows[: len(LOSS_TYPES)]] == list(LOSS_TYPES)
    assert all(r.objective and r.normalization for r in rows[: len(LOSS_TYPES)])
    assert set(IS_MODES) == {m for m, *_ in filter(None, IS_CASES.values())}
    docs = (Path(__file__).parents[2] / "docs" / "objectives.md").read_text()
    assert "## TRL 1.16" in docs
    assert mapping_table() in docs, (
        "regenerate the table: python -c 'from packloss.integrations.trl import *; print(mapping_table())'"
    )
