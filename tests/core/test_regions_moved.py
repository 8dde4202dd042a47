"""MOVED: TRL-born regions and the ratio-weighted KL, against paper references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from conftest import bin_of, check_against_paper, packings, poison_non_members, with_old
from packloss import (
    PolicyGradient,
    RolloutCorrection,
    compute_loss,
)
from packloss.core.kl import RatioWeightedKL
from packloss.core.trust_regions import VESPO, CISPOCap, SequenceLevel
from packloss.testing import OpCounter
from tests.integrations.trl.harness import REGIONS, _kl_reference, _module_objectives


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
