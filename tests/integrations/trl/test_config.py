"""``from_trl``: every loss type, level, KL and vLLM option equals TRL 1.16's own ``_compute_loss``
(one micro-batch and gradient accumulation, float64), and unmapped options raise naming the option."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from packloss import (
    compute_loss,
    count_denominators,
)
from packloss.core.top_entropy import TopEntropy
from packloss.core.trust_regions import GSPO, PPOClip
from packloss.integrations.trl import TRL_DEFAULTS, from_trl
from packloss.testing.trl import OneProcess
from tests.integrations.trl.harness import (
    F64,
    VARIANTS,
    _vespo_rejects,
    assert_close,
    assert_differ,
    assert_differ_at,
    cases,
    config,
    grad,
    members_per_row,
    packed,
    packloss_loss,
    padded_batch,
    seed_of,
    trl_loss,
)


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
        (dict(top_entropy_quantile=1.5), ValueError, r"GRPOConfig.top_entropy_quantile must be in \[0, 1\]"),
        (dict(off_policy_mask_threshold=float("nan")), ValueError, "off_policy_mask_threshold must be finite"),
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
        (dict(loss_type="dr_grpo", max_completion_length=None), TypeError, "GRPOConfig.max_completion_length"),
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
    with pytest.raises(ValueError, match="num_processes must be >= 1"):
        from_trl(SimpleNamespace(), num_processes=0)
    with pytest.raises(TypeError, match="needs a GRPOConfig"):
        from_trl(None)


@pytest.mark.parametrize("name", ["off_policy_mask_vllm", "off_policy_mask_old"])
def test_off_policy_mask_variants_drop_some_negative_rows(name):
    """The masking variants above are not vacuous: by TRL's own ``get_off_policy_mask`` on their batch,
    some rows with a negative advantage are dropped and some kept."""
    options = VARIANTS[name]
    b = padded_batch(seed=len(name), rows=6)
    base = b.sampling if options.get("use_vllm") else b.old
    mask = (b.completion_mask * b.tool_mask).to(F64)
    keep = GRPOTrainer.get_off_policy_mask(b.adv[:, None], b.logps, base, mask, options["off_policy_mask_threshold"])
    negative = b.adv < 0
    assert 0 < int((keep[:, 0] == 0).sum()) < int(negative.sum())


# ---------------------------------------------------------------------------------------------------
# top_entropy_quantile
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def trl_pads_on_one_process(monkeypatch):
    """TRL's ``get_high_entropy_mask`` pads across processes: the identity on one process."""
    monkeypatch.setattr(OneProcess, "pad_across_processes", staticmethod(lambda x, **kwargs: x), raising=False)


TOP_ENTROPY_CASES = {
    "dapo-token": ("dapo", "token", "beta0", "off"),
    "grpo-sequence-kl": ("grpo", "sequence", "beta_kl", "token_truncate"),  # the k3 penalty is not masked
    "bnpo-kl_bias_corrected": ("bnpo", "token", "beta_kl_bias_corrected", "sequence_mask"),
    "cispo-token": ("cispo", "token", "beta0", "on_policy"),
    "vespo-token": ("vespo", "token", "beta_kl", "token_mask"),
    "luspo-sequence": ("luspo", "sequence", "beta0", "off"),
    "sapo-sequence": ("sapo", "sequence", "beta0", "off"),
}


@pytest.mark.usefixtures("trl_pads_on_one_process")
@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.7])
@pytest.mark.parametrize("name", sorted(TOP_ENTROPY_CASES))
def test_top_entropy_quantile_matches_trl(name, quantile):
    """3 micro-batches: TRL's quantile is per ``_compute_loss`` call, i.e. each bin's own (one process); at
    sequence level the mask weighs a sequence's tokens unequally, so TRL's differentiable ``s_i`` is
    ``SequenceLevel`` (GSPO-token's gradient would differ). Entropies in float32 (the trainer's dtype; TRL
    takes its quantile in float32 whatever theirs): loss and gradient within 1e-10."""
    loss_type, level, beta, is_case = TOP_ENTROPY_CASES[name]
    cfg = config(loss_type, level, beta, is_case, rows=4, accumulation=3, top_entropy_quantile=quantile)
    b = padded_batch(seed=seed_of(name, "top_entropy"), rows=12, empty_rows=(6,))
    b.entropies = b.entropies.float()
    micro = [slice(0, 4), slice(4, 8), slice(8, 12)]
    old_given = is_case != "on_policy"
    recipe = from_trl(cfg)
    assert recipe.objective.top_entropy == TopEntropy(quantile)
    trl = trl_loss(cfg, b, micro, old_given)
    ours = packloss_loss(recipe, b, micro, old_given)
    if loss_type in ("grpo", "sapo"):
        ours = ours * (members_per_row(b) > 0).sum().to(F64) / 12  # TRL's mean counts the empty row
    if loss_type == "bnpo":
        ours = packloss_loss(recipe, b, micro, old_given, step=False) / 3
    assert_close(ours, trl)
    assert_close(grad(ours, b), grad(trl, b))
    everything = SimpleNamespace(**{**vars(cfg), "top_entropy_quantile": 1.0})
    assert_differ(trl_loss(everything, b, micro, old_given), trl)  # the mask drops tokens here


@pytest.mark.usefixtures("trl_pads_on_one_process")
def test_top_entropy_mask_is_trls_on_float32_entropies():
    """The kept tokens equal TRL's own ``get_high_entropy_mask`` on float32 entropies (the trainer's dtype),
    ties included, and some but not all members are kept."""
    b = padded_batch(seed=21, rows=6)
    mask = b.completion_mask * b.tool_mask
    trainer = SimpleNamespace(accelerator=OneProcess())
    for entropies in (b.entropies.float(), (b.entropies * 2).round().float() / 2):
        for quantile in (0.0, 0.2, 0.5, 1.0):
            expected = GRPOTrainer.get_high_entropy_mask(trainer, entropies, mask, 1 - quantile)
            valid = b.valid
            got = TopEntropy(quantile).keep(entropies[valid], mask.bool()[valid])
            assert torch.equal(got, expected[valid]), quantile
            assert not expected[~valid].any()
            if 0 < quantile < 1:
                assert 0 < int(got.sum()) < int(mask.sum())
