"""packloss.integrations.openrlhf against OpenRLHF 0.11.2's own ``PolicyLoss`` and ``aggregate_loss``, in float64.

OpenRLHF's side is its installed ``openrlhf/models/loss.py``, loaded by file
(``tests/integrations/openrlhf/harness.py``; OpenRLHF's full dependency set does not install on a CPU
machine: flash-attn builds from source against CUDA). Without it the tests that call OpenRLHF skip.

Batches are OpenRLHF's padded ``[B, T]`` micro-batches: ragged action masks with holes (integer, as
OpenRLHF's samples generator builds them, or bool) and rows without any action token; padding
positions hold random finite values (OpenRLHF multiplies by the mask, so inf there would make its loss
NaN; packloss's NaN-safety is tested separately).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import math
import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

from conftest import ROOT
from packloss import (
    ComponentOutput,
    GatedCorrection,
    Outputs,
    PaddedLayout,
    Plan,
    PolicyGradient,
    RolloutCorrection,
    compute_loss,
)
from packloss.core.trust_regions import GSPO, ClampedPPOClip, PPOClip, SequenceRatioClip
from packloss.integrations.common.padded import PaddedBatch
from packloss.integrations.openrlhf import (
    OPENRLHF_VERSION,
    PolicyLoss,
    aggregate_component,
    policy_gradient,
)
from packloss.testing import OpCounter
from tests.integrations.openrlhf.harness import ORL, needs_openrlhf

F64 = torch.float64
RTOL = 1e-10
ATOL = 1e-13  # sums of O(1) terms of mixed sign: absolute floor for values that cancel towards 0
DOC = ROOT / "docs" / "integrations" / "openrlhf.md"


def test_openrlhf_is_installed_in_ci():
    """CI installs OpenRLHF (`make test`): there, a skipped comparison would be a silent pass."""
    import os

    if os.environ.get("CI") == "true":
        assert ORL is not None, f"CI must install OpenRLHF: pip install --no-deps openrlhf=={OPENRLHF_VERSION}"


@needs_openrlhf
def test_installed_openrlhf_is_the_mapped_release():
    assert importlib.metadata.version("openrlhf") == OPENRLHF_VERSION


# ---------------------------------------------------------------------------------------------------
# Batches and settings
# ---------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    log_probs: Tensor
    old: Tensor
    rollout: Tensor
    adv: Tensor
    mask: Tensor

    def replace(self, **fields) -> Batch:
        return Batch(**{**self.__dict__, **fields})


def make_batch(
    seed: int,
    b: int = 6,
    t: int = 12,
    *,
    empty_rows: int = 2,
    per_token_adv: bool = True,
    mask_dtype: torch.dtype = torch.long,
    spread: float = 0.4,
) -> Batch:
    """Ragged ``[b, t]`` action masks (a window per row, with holes), ``empty_rows`` rows without action
    tokens (at least one row keeps a member), and log-probs whose ratios reach the clip, dual-clip and
    correction bands."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(t)
    start = torch.randint(0, t, (b, 1), generator=g)
    length = torch.randint(1, t + 1, (b, 1), generator=g)
    mask = (pos >= start) & (pos < start + length) & (torch.rand(b, t, generator=g) < 0.8)
    mask[torch.randperm(b, generator=g)[: min(empty_rows, b - 1)]] = False
    if not bool(mask.any()):
        keep = int(torch.randint(0, b, (1,), generator=g))
        mask[keep, int(torch.randint(0, t, (1,), generator=g))] = True
    old = -(torch.rand(b, t, generator=g, dtype=F64) * 3 + 0.01)
    log_probs = old + spread * torch.randn(b, t, generator=g, dtype=F64)
    rollout = old + spread * torch.randn(b, t, generator=g, dtype=F64)
    if per_token_adv:
        adv = torch.randn(b, t, generator=g, dtype=F64)
    else:
        adv = torch.randn(b, 1, generator=g, dtype=F64).expand(b, t).clone()
    return Batch(log_probs, old, rollout, adv, mask.to(mask_dtype))


# (level, mode, gating, threshold): OpenRLHF's named schemes and every gate
CORRECTIONS = {
    "off": ("off", "mask", "ratio", (0.5, 5.0)),
    "tis": ("token", "clip", "ratio", (0.8, 1.25)),
    "tis_upper": ("token", "clip", "ratio", (0.0, 1.1)),
    "icepop": ("token", "mask", "ratio", (0.8, 1.25)),
    "seq_mask_tis": ("seq", "mask", "ratio", (0.8, 1.25)),
    "token_binary_kl": ("token", "mask", "binary_kl", (0.0, 0.02)),
    "seq_binary_kl": ("seq", "mask", "binary_kl", (0.0, 0.04)),
    "token_tv": ("token", "mask", "tv", (0.0, 0.1)),
    "seq_tv": ("seq", "mask", "tv", (-1.0, 0.08)),
}
# aggregation: (dp_size, counts) — None: this micro-batch's own counts; "tensor"/"float": the step's
AGGREGATIONS = {
    "local": (1, None),
    "local_dp2": (2, None),
    "step": (1, "tensor"),
    "step_dp2": (2, "tensor"),
    "step_dp3_float": (3, "float"),
}


def settings_of(loss_type: str, correction: str, token_level: bool, dual_clip, clip=(0.2, 0.2)) -> dict:
    level, mode, gating, threshold = CORRECTIONS[correction]
    return dict(
        clip_eps_low=clip[0],
        clip_eps_high=clip[1],
        dual_clip=dual_clip,
        token_level_loss=token_level,
        policy_loss_type=loss_type,
        is_correction_level=level,
        is_correction_mode=mode,
        is_correction_gating=gating,
        is_correction_threshold=threshold,
    )


def step_counts(batch: Batch, aggregation: str) -> dict:
    """OpenRLHF's ``loss_batch_info``: the step's token and non-empty-row counts (this micro-batch's
    times 2.5 here, as if the step had more), ``/ gas`` with gas = 2, as float32 tensors or floats."""
    dp_size, kind = AGGREGATIONS[aggregation]
    if kind is None:
        return {"dp_size": dp_size}
    mask = batch.mask.bool()
    tokens = mask.sum().to(torch.float32) * 2.5 / 2
    rows = (mask.sum(1) > 0).sum().to(torch.float32) * 2.5 / 2
    if kind == "float":
        tokens, rows = float(tokens), float(rows)
    return {"dp_size": dp_size, "batch_num_tokens": tokens, "global_batch_size": rows}


def run(loss_fn, batch: Batch, counts: dict) -> tuple[tuple, Tensor]:
    """``loss_fn``'s outputs and the gradient of its loss w.r.t. a fresh leaf of ``batch.log_probs``."""
    log_probs = batch.log_probs.clone().requires_grad_()
    out = loss_fn(log_probs, batch.old, batch.adv, action_mask=batch.mask, rollout_log_probs=batch.rollout, **counts)
    out[0].backward()
    return out, log_probs.grad


def assert_agree(ours: tuple, ours_grad: Tensor, theirs: tuple, theirs_grad: Tensor) -> None:
    loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio = ours
    torch.testing.assert_close(loss, theirs[0].to(loss.dtype), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=RTOL, atol=ATOL)
    # fractions: float32 counts over float32 counts on both sides, the same numbers
    assert clip_ratio.dtype == theirs[1].dtype == torch.float32
    assert torch.equal(clip_ratio, theirs[1]), (clip_ratio, theirs[1])
    torch.testing.assert_close(ppo_kl, theirs[2], rtol=RTOL, atol=ATOL)
    assert (vllm_kl is None) == (theirs[3] is None)
    assert (is_filter_ratio is None) == (theirs[4] is None)
    if vllm_kl is not None:
        torch.testing.assert_close(vllm_kl, theirs[3], rtol=RTOL, atol=ATOL)
        assert torch.equal(is_filter_ratio, theirs[4].to(torch.float32)), (is_filter_ratio, theirs[4])


def check_case(kwargs: dict, batch: Batch, aggregation: str, packing: str = "members") -> tuple:
    counts = step_counts(batch, aggregation)
    theirs, theirs_grad = run(ORL.PolicyLoss(**kwargs), batch, counts)
    ours, ours_grad = run(PolicyLoss(**kwargs, packing=packing), batch, counts)
    assert_agree(ours, ours_grad, theirs, theirs_grad)
    return ours, theirs


# ---------------------------------------------------------------------------------------------------
# Equality with OpenRLHF: every loss type × correction × aggregation
# ---------------------------------------------------------------------------------------------------

CASES = list(itertools.product(("ppo", "gspo"), CORRECTIONS, (True, False), AGGREGATIONS))


@needs_openrlhf
@pytest.mark.parametrize("loss_type, correction, token_level, aggregation", CASES)
def test_policy_loss_equals_openrlhf(loss_type, correction, token_level, aggregation):
    i = CASES.index((loss_type, correction, token_level, aggregation))
    dual_clip = (None, 1.5)[i % 2]  # dual clip on every other case: both in every loss type × correction
    clip = ((0.2, 0.2), (0.1, 0.28))[(i // 2) % 2]
    kwargs = settings_of(loss_type, correction, token_level, dual_clip, clip)
    filtered = []
    for seed in range(2):
        batch = make_batch(seed + 10 * i, mask_dtype=(torch.long, torch.bool)[seed % 2])
        ours, _ = check_case(kwargs, batch, aggregation, packing=("members", "rows")[(i + seed) % 2])
        filtered.append(None if ours[4] is None else float(ours[4]))
    if correction != "off" and loss_type == "ppo":  # the band drops some units and keeps others
        assert any(0 < f < 1 for f in filtered), filtered


@needs_openrlhf
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    loss_type=st.sampled_from(("ppo", "gspo")),
    correction=st.sampled_from(sorted(CORRECTIONS)),
    token_level=st.booleans(),
    aggregation=st.sampled_from(sorted(AGGREGATIONS)),
    dual_clip=st.sampled_from((None, 1.2, 3.0)),
    clip=st.sampled_from(((0.2, 0.2), (0.0, 0.0), (0.1, 0.28), (0.5, 2.0))),
    shape=st.tuples(st.integers(1, 9), st.integers(1, 17)),
    empty_rows=st.integers(0, 4),
    per_token_adv=st.booleans(),
    spread=st.sampled_from((0.05, 0.4, 1.5)),
    packing=st.sampled_from(("members", "rows")),
    seed=st.integers(0, 2**16),
)
def test_policy_loss_equals_openrlhf_random(
    loss_type,
    correction,
    token_level,
    aggregation,
    dual_clip,
    clip,
    shape,
    empty_rows,
    per_token_adv,
    spread,
    packing,
    seed,
):
    kwargs = settings_of(loss_type, correction, token_level, dual_clip, clip)
    batch = make_batch(seed, *shape, empty_rows=empty_rows, per_token_adv=per_token_adv, spread=spread)
    check_case(kwargs, batch, aggregation, packing)


@needs_openrlhf
@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_aggregate_component_equals_aggregate_loss(token_level, aggregation):
    """Any per-token loss under :func:`aggregate_component` equals OpenRLHF's ``aggregate_loss`` (its
    actor's KL and entropy terms use it too), value and gradient."""
    for seed in range(4):
        batch = make_batch(seed, 7, 11)
        counts = step_counts(batch, aggregation)
        per_token = torch.randn(7, 11, dtype=F64, generator=torch.Generator().manual_seed(seed)).requires_grad_()
        theirs = ORL.aggregate_loss(per_token, batch.mask, token_level_loss=token_level, **counts)
        (theirs_grad,) = torch.autograd.grad(theirs, per_token)

        members = batch.mask.bool()
        layout = PaddedLayout.from_attention_mask(members | (torch.arange(11) == 0))  # every row a sequence
        packed = layout.pack(per_token)
        component = aggregate_component(
            lambda inputs, packed=packed: ComponentOutput(per_token=packed),
            members,
            PaddedBatch(layout, layout.pack(members)),
            token_level,
            dtype=F64,
            **counts,
        )
        ours = compute_loss(Plan(layout.seq_lens, {"x": component}), Outputs(logprobs=packed)).loss
        (ours_grad,) = torch.autograd.grad(ours, per_token)
        torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(ours_grad, theirs_grad, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------------
# Each mapped detail matters: without it, packloss's nearest objective differs from OpenRLHF
# ---------------------------------------------------------------------------------------------------


def _packloss_with(objective: PolicyGradient, kwargs: dict, batch: Batch) -> tuple[Tensor, Tensor]:
    """packloss's loss and gradient for ``objective`` with the packing and normalisation of
    ``PolicyLoss(**kwargs)`` (this micro-batch's counts)."""
    members = batch.mask.bool()
    layout = PaddedLayout.from_attention_mask(members | (torch.arange(members.shape[1]) == 0))
    log_probs = batch.log_probs.clone().requires_grad_()
    token_level = PolicyLoss(**kwargs).token_level_loss
    component = aggregate_component(
        objective, members, PaddedBatch(layout, layout.pack(members)), token_level, dtype=F64
    )
    plan = Plan(
        layout.seq_lens,
        {"pg": component},
        rollout_logprobs=layout.pack(batch.rollout),
        old_logprobs=layout.pack(batch.old),
        advantages=layout.pack(batch.adv),
    )
    loss = compute_loss(plan, Outputs(logprobs=layout.pack(log_probs))).loss
    loss.backward()
    return loss, log_probs.grad


@needs_openrlhf
@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_ppo_log_ratio_clamp_is_openrlhf(sign):
    """OpenRLHF's ``ppo`` clamps ``log r`` to ``[−20, 20]``: a token with ``log r = 25`` and ``A < 0`` (or
    ``−25`` and ``A > 0``) has ``r = e^±20`` and no gradient. ClampedPPOClip agrees; PPOClip does not."""
    batch = make_batch(3, empty_rows=0)
    lp, adv = batch.log_probs.clone(), batch.adv.clone()
    row, col = (batch.mask.bool()).nonzero()[0].tolist()
    lp[row, col] = batch.old[row, col] + 25.0 * -sign
    adv[row, col] = sign
    batch = batch.replace(log_probs=lp, adv=adv)
    kwargs = settings_of("ppo", "off", True, None)
    check_case(kwargs, batch, "local")
    theirs, theirs_grad = run(ORL.PolicyLoss(**kwargs), batch, {})
    loss, grad = _packloss_with(PolicyGradient(PPOClip(0.2, 0.2)), kwargs, batch)
    assert not torch.allclose(grad, theirs_grad, rtol=1e-6, atol=0), "PPOClip's gradient should differ there"
    assert not math.isclose(float(loss), float(theirs[0]), rel_tol=1e-6) or sign > 0


@needs_openrlhf
@pytest.mark.parametrize("correction", ["off", "tis"])
def test_gspo_sequence_ratio_has_its_full_gradient(correction):
    """OpenRLHF's ``gspo`` differentiates ``s_i`` itself. With per-token advantages GSPO-token's gradient
    (packloss's GSPO, ``sg(s_i)·exp(trn − sg(trn))``) differs; with one advantage per sequence and no
    dual clip they agree."""
    kwargs = settings_of("gspo", correction, False, None, (0.2, 0.2))
    ratio = "rollout" if correction != "off" else "old"
    for per_token_adv in (True, False):
        batch = make_batch(5, per_token_adv=per_token_adv)
        check_case(kwargs, batch, "local")
        theirs, theirs_grad = run(ORL.PolicyLoss(**kwargs), batch, {})
        loss, grad = _packloss_with(PolicyGradient(GSPO(0.2, 0.2), ratio=ratio), kwargs, batch)
        torch.testing.assert_close(loss, theirs[0], rtol=RTOL, atol=ATOL)  # same value
        if per_token_adv:
            assert not torch.allclose(grad, theirs_grad, rtol=1e-6, atol=1e-9)
        else:
            torch.testing.assert_close(grad, theirs_grad, rtol=RTOL, atol=ATOL)


@needs_openrlhf
def test_sequence_gate_keeps_the_token_ratio():
    """OpenRLHF's seq-level mask gates on the sequence's geometric-mean ratio and weights by each token's
    ratio; RolloutCorrection(level="sequence", mode="mask") would weight by the sequence ratio."""
    kwargs = settings_of("ppo", "seq_mask_tis", True, None)
    batch = make_batch(7)
    check_case(kwargs, batch, "local")
    theirs, _ = run(ORL.PolicyLoss(**kwargs), batch, {})
    core = RolloutCorrection("sequence", "mask", high=1.25, low=0.8, sequence_agg="mean")
    loss, _ = _packloss_with(PolicyGradient(ClampedPPOClip(), correction=core), kwargs, batch)
    assert not math.isclose(float(loss), float(theirs[0]), rel_tol=1e-6)


@needs_openrlhf
def test_sequence_filter_ratio_counts_rows_without_action_tokens():
    """OpenRLHF's seq-level ``is_filter_ratio`` is over all ``B`` rows and a row without action tokens
    counts as filtered (its gate reads NaN); with a band that keeps every row it is ``empty / B``."""
    kwargs = settings_of("ppo", "seq_mask_tis", True, None) | {"is_correction_threshold": (0.0, 1e9)}
    batch = make_batch(8, b=8, empty_rows=3)
    ours, theirs = check_case(kwargs, batch, "local")
    empty = int((batch.mask.sum(1) == 0).sum())
    assert empty == 3 and float(ours[4]) == float(theirs[4]) == empty / 8


@needs_openrlhf
def test_dp_size_and_counts_scale_the_loss():
    """The step counts are used: dp_size multiplies the loss, the micro-batch's own counts differ."""
    kwargs = settings_of("ppo", "off", True, None)
    batch = make_batch(9)
    loss_fn = PolicyLoss(**kwargs)
    step = step_counts(batch, "step")
    one = run(loss_fn, batch, step)[0][0]
    three = run(loss_fn, batch, step | {"dp_size": 3})[0][0]
    local = run(loss_fn, batch, {"dp_size": 3})[0][0]
    torch.testing.assert_close(three, 3 * one, rtol=RTOL, atol=0)
    assert not math.isclose(float(local), float(three), rel_tol=1e-6)


# ---------------------------------------------------------------------------------------------------
# Documented differences
# ---------------------------------------------------------------------------------------------------


@needs_openrlhf
@pytest.mark.parametrize("token_level", [True, False])
def test_no_action_token_is_zero_not_nan(token_level):
    """A micro-batch without any action token: OpenRLHF's means divide by zero (NaN); packloss gives 0
    and a zero gradient."""
    batch = make_batch(4)
    batch = batch.replace(mask=torch.zeros_like(batch.mask))
    kwargs = settings_of("ppo", "tis", token_level, None)
    theirs, _ = run(ORL.PolicyLoss(**kwargs), batch, {})
    (loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio), grad = run(PolicyLoss(**kwargs), batch, {})
    assert math.isnan(float(theirs[0])) and math.isnan(float(theirs[1])) and math.isnan(float(theirs[2]))
    for value in (loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio):
        assert float(value) == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))


@needs_openrlhf
@pytest.mark.parametrize("loss_type, correction", [("ppo", "tis"), ("ppo", "seq_binary_kl"), ("gspo", "tis")])
@pytest.mark.parametrize("packing", ["members", "rows"])
def test_padding_values_never_enter(loss_type, correction, packing):
    """inf / NaN on padding positions (every stream): OpenRLHF's loss is NaN, packloss's equals OpenRLHF's
    on the clean batch, gradient included."""
    kwargs = settings_of(loss_type, correction, False, 1.5)
    clean = make_batch(11)
    theirs, theirs_grad = run(ORL.PolicyLoss(**kwargs), clean, {})
    pad = ~clean.mask.bool()
    poisoned = clean.replace(
        log_probs=clean.log_probs.masked_fill(pad, float("nan")),
        old=clean.old.masked_fill(pad, float("-inf")),
        rollout=clean.rollout.masked_fill(pad, float("inf")),
        adv=clean.adv.masked_fill(pad, float("nan")),
    )
    assert math.isnan(float(run(ORL.PolicyLoss(**kwargs), poisoned, {})[0][0]))
    ours, ours_grad = run(PolicyLoss(**kwargs, packing=packing), poisoned, {})
    assert_agree(ours, ours_grad, theirs, theirs_grad)


def test_bf16_inputs_compute_in_float32():
    batch = make_batch(3)
    bf16 = batch.replace(**{k: getattr(batch, k).to(torch.bfloat16) for k in ("log_probs", "old", "rollout", "adv")})
    (loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio), grad = run(
        PolicyLoss(is_correction_level="token", is_correction_threshold=(0.8, 1.25)), bf16, {}
    )
    assert {x.dtype for x in (loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)} == {torch.float32}
    assert grad.dtype == torch.bfloat16 and bool(torch.isfinite(grad).all())


def test_floating_point_action_mask_is_not_mapped():
    batch = make_batch(1)
    with pytest.raises(NotImplementedError, match="action_mask of dtype torch.float64"):
        run(PolicyLoss(), batch.replace(mask=batch.mask.to(F64)), {})


# ---------------------------------------------------------------------------------------------------
# Hot path: sync-free (packing="rows") and flat in the number of rows
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", ["members", "rows"])
@pytest.mark.parametrize(
    "loss_type, correction, token_level",
    [
        ("ppo", "tis", True),
        ("ppo", "seq_binary_kl", False),
        ("gspo", "icepop", False),
        ("ppo", "token_tv", True),
    ],
)
def test_sync_free_and_flat(packing, loss_type, correction, token_level):
    loss_fn = PolicyLoss(**settings_of(loss_type, correction, token_level, 2.0), packing=packing)
    totals = set()
    # from 2 rows: Layout.build's repeat_interleave takes a shorter path (view + expand) for one sequence
    for rows in (2, 16, 256):
        batch = make_batch(rows, b=rows, t=32, empty_rows=rows // 4)
        counts = step_counts(batch, "step")
        log_probs = batch.log_probs.clone().requires_grad_()
        with OpCounter() as counter:
            out = loss_fn(log_probs, batch.old, batch.adv, batch.mask, batch.rollout, **counts)
            out[0].backward()
        if packing == "rows":  # "members" reads the row lengths (one sync on a GPU; a CPU copy here)
            assert counter.num_syncs == 0, counter.syncs
        totals.add(counter.total)
    assert len(totals) == 1, totals


# ---------------------------------------------------------------------------------------------------
# Settings: the mapping and its validation
# ---------------------------------------------------------------------------------------------------


def test_mapping():
    obj = policy_gradient(0.1, 0.28, 3.0)
    assert obj.trust_region == ClampedPPOClip(0.1, 0.28, 3.0) and obj.ratio == "old" and obj.correction is None
    obj = policy_gradient(policy_loss_type="gspo", is_correction_level="token")
    assert isinstance(obj.trust_region, SequenceRatioClip) and obj.ratio == "rollout" and obj.correction is None
    tis = policy_gradient(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=(0.0, 2.0))
    assert tis.correction == RolloutCorrection("token", "truncate", high=2.0, low=None)
    icepop = policy_gradient(is_correction_level="token", is_correction_threshold=(0.5, 5.0))
    assert icepop.correction == RolloutCorrection("token", "mask", high=5.0, low=0.5)
    seq = policy_gradient(is_correction_level="seq", is_correction_gating="tv", is_correction_threshold=(0.0, 0.1))
    assert seq.correction == GatedCorrection(level="sequence", high=0.1, low=None, gating="tv")
    assert PolicyLoss(policy_loss_type="gspo", token_level_loss=True).token_level_loss is False


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"policy_loss_type": "grpo"}, ValueError, "PolicyLoss.policy_loss_type must be one of"),
        ({"dual_clip": 1.0}, ValueError, "PolicyLoss.dual_clip must be > 1.0"),
        ({"dual_clip": float("nan")}, ValueError, "PolicyLoss.dual_clip must be finite"),
        ({"clip_eps_low": 1.0}, ValueError, "PolicyLoss.clip_eps_low must be in"),
        ({"clip_eps_high": -0.1}, ValueError, "PolicyLoss.clip_eps_high must be >= 0"),
        ({"clip_eps_high": "0.2"}, TypeError, "PolicyLoss.clip_eps_high must be a number"),
        ({"token_level_loss": 1}, TypeError, "PolicyLoss.token_level_loss must be a bool"),
        ({"is_correction_level": "sequence"}, ValueError, "PolicyLoss.is_correction_level must be one of"),
        ({"is_correction_mode": "truncate"}, ValueError, "PolicyLoss.is_correction_mode must be one of"),
        ({"is_correction_gating": "kl"}, ValueError, "PolicyLoss.is_correction_gating must be one of"),
        (
            {"is_correction_level": "seq", "is_correction_mode": "clip"},
            ValueError,
            "is_correction_mode=clip requires is_correction_level=token",
        ),
        (
            {"is_correction_level": "token", "is_correction_mode": "clip", "is_correction_gating": "tv"},
            ValueError,
            "is_correction_mode=clip requires",
        ),
        ({"is_correction_level": "token", "is_correction_gating": "tv"}, ValueError, "takes an upper bound only"),
        ({"is_correction_level": "token", "is_correction_threshold": (2.0, 1.0)}, ValueError, "low < high"),
        ({"is_correction_level": "token", "is_correction_threshold": (-1.0, 0.0)}, ValueError, "high must be > 0"),
        ({"is_correction_level": "token", "is_correction_threshold": (0.5,)}, ValueError, "must be \\(low, high\\)"),
        ({"is_correction_level": "token", "is_correction_threshold": (0.5, math.inf)}, ValueError, "finite"),
        ({"packing": "tight"}, ValueError, "PolicyLoss.packing must be one of"),
    ],
)
def test_settings_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        PolicyLoss(**kwargs)


def test_forward_validation():
    batch = make_batch(2)
    loss_fn = PolicyLoss(is_correction_level="token")
    with pytest.raises(ValueError, match="rollout_log_probs is required"):
        loss_fn(batch.log_probs, batch.old, batch.adv, batch.mask)
    with pytest.raises(ValueError, match=r"old_log_probs must have shape \[B, T\]"):
        loss_fn(batch.log_probs, batch.old[:, 1:], batch.adv, batch.mask, batch.rollout)
    with pytest.raises(ValueError, match=r"log_probs must be a \[B, T\] tensor"):
        loss_fn(batch.log_probs[0], batch.old, batch.adv, batch.mask, batch.rollout)
    with pytest.raises(ValueError, match="dp_size must be"):
        loss_fn(batch.log_probs, batch.old, batch.adv, batch.mask, batch.rollout, dp_size=0)
    with pytest.raises(ValueError, match="batch_num_tokens must be > 0"):
        loss_fn(batch.log_probs, batch.old, batch.adv, batch.mask, batch.rollout, batch_num_tokens=0.0)
    with pytest.raises(TypeError, match="advantages must be a floating-point tensor"):
        loss_fn(batch.log_probs, batch.old, batch.mask, batch.mask, batch.rollout)


def test_no_action_mask_means_every_position():
    batch = make_batch(6)
    full = batch.replace(mask=torch.ones_like(batch.mask))
    loss_fn = PolicyLoss(token_level_loss=False)
    (none_out, none_grad), (full_out, full_grad) = run(loss_fn, batch.replace(mask=None), {}), run(loss_fn, full, {})
    torch.testing.assert_close(none_out[0], full_out[0], rtol=0, atol=0)
    torch.testing.assert_close(none_grad, full_grad, rtol=0, atol=0)


def test_gated_correction_validation():
    with pytest.raises(ValueError, match="GatedCorrection.gating must be one of"):
        GatedCorrection(gating="kl")
    with pytest.raises(ValueError, match="mode='mask', weighted=True"):
        GatedCorrection(mode="truncate")


# ---------------------------------------------------------------------------------------------------
# The docs' snippet runs
# ---------------------------------------------------------------------------------------------------


def test_docs_snippet_runs():
    """The ```python blocks of docs/integrations/openrlhf.md run, in order, as one program (the ```py
    block patches OpenRLHF's actor and needs its GPU stack)."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks
    namespace: dict = {}
    exec(compile("\n".join(blocks), str(DOC), "exec"), namespace)
    assert namespace["log_probs"].grad is not None and namespace["log_probs"].grad.abs().sum() > 0
    assert torch.isfinite(namespace["loss"]) and namespace["is_filter_ratio"] is not None
