"""packloss.core.trust_regions.base: the registry (register_trust_region, trust_region), TrustRegion.check,
PolicyTerms, SelectionStreams and StepSelector's contract."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

from conftest import bin_of, check_against_paper, with_old
from packloss import PolicyGradient, compute_loss
from packloss.core.pg import PolicyInputs, policy_terms
from packloss.core.segments import Segments
from packloss.core.trust_regions import (
    DPPOKL,
    DPPOTV,
    GMPO,
    GPG,
    SAPO,
    TOPR,
    TRUST_REGIONS,
    ClipCov,
    DPPOMask,
    PolicyTerms,
    PPOClip,
    SelectionStreams,
    Surrogate,
    TrustRegion,
    register_trust_region,
    trust_region,
)

FAMILIES = {
    "masking": {"dppo", "ipo", "one_sided", "none", "icepop", "icepop_log", "dppo_tv", "dppo_kl"},
    "clipping": {"ppo_clip", "ppo_clip_clamped", "cispo", "cispo_cap", "sapo"},
    "sequence": {"gspo", "sequence_level", "sequence_ratio_clip", "geo_mean"},
    "reinforce": {"gpg", "topr", "vespo"},
    "selection": {"clip_cov", "kl_cov", "m2po"},
}
"""Every built-in region by the module of its family (``packloss.core.trust_regions.<family>``)."""


def test_register_a_trust_region_in_user_code():
    """A user's region, registered in their own module, runs through the engine by name."""

    @register_trust_region("test_band")
    @dataclass(frozen=True)
    class Band(TrustRegion):
        eps: float = 0.1

        def surrogate(self, t: PolicyTerms) -> Surrogate:
            kept = t.m & ((t.r - 1).abs() <= self.eps)
            return Surrogate(kept * t.a * t.r, {"is_masked": t.m & ~kept})

    try:
        assert TRUST_REGIONS["test_band"] is Band
        case = ([4, 3], 5, [False, False], False)

        def paper(seq):
            ratio = (seq.trn - seq.inf).exp()
            return -((ratio - 1).abs() <= 0.1).to(ratio.dtype).mul(seq.adv * ratio).sum()

        check_against_paper(PolicyGradient("test_band", ratio="rollout"), paper, case)
        with pytest.raises(ValueError, match="already registered"):
            register_trust_region("test_band")(type("Other", (TrustRegion,), {}))
    finally:
        TRUST_REGIONS.pop("test_band", None)


def test_new_regions_are_registered_with_verl_defaults():
    """Names resolve to the classes; defaults are verl 0.9.1's ActorConfig values (tau_pos/neg,
    clip_ratio_low/high, clip_ratio_c) and the TOPR paper's [·]_0^1."""
    assert trust_region("sapo") == SAPO(tau_pos=1.0, tau_neg=1.05)
    assert trust_region("geo_mean") == GMPO(clip_low=0.2, clip_high=0.2, eps=0.0)
    assert trust_region("gpg") == GPG()
    assert trust_region("dppo_tv") == DPPOTV(low=0.2, high=0.2, ratio_cap=3.0)
    assert trust_region("dppo_kl") == DPPOKL(low=0.2, high=0.2, ratio_cap=3.0)
    assert trust_region("topr") == TOPR(low=0.0, high=1.0)
    assert TRUST_REGIONS["dppo"] is DPPOMask  # prime-rl's binary DPPO keeps its name


def test_every_region_lives_in_its_family_module_under_its_name():
    assert set(TRUST_REGIONS) == set().union(*FAMILIES.values())
    for family, names in FAMILIES.items():
        for name in names:
            cls = TRUST_REGIONS[name]
            assert cls.__module__ == f"packloss.core.trust_regions.{family}", (name, cls.__module__)
            assert cls.name == name
            assert type(trust_region(name)) is cls  # its defaults build


def test_trust_region_resolves_instances_and_names_and_refuses_the_rest():
    region = PPOClip(0.1, 0.3)
    assert trust_region(region) is region
    assert trust_region("ppo_clip") == PPOClip(0.2, 0.2, None)
    with pytest.raises(ValueError, match="trust_region must be a TrustRegion or one of .*'ppo_clip'.*got 'box'"):
        trust_region("box")
    with pytest.raises(TypeError, match=r"got the class PPOClip: write PPOClip\(\)"):
        trust_region(PPOClip)
    with pytest.raises(TypeError, match="must be a TrustRegion or a registered name, got float"):
        trust_region(0.2)


def test_register_trust_region_refuses_bad_names_and_classes():
    with pytest.raises(TypeError, match="name must be a non-empty string"):
        register_trust_region("")
    with pytest.raises(TypeError, match="name must be a non-empty string"):
        register_trust_region(3)
    with pytest.raises(TypeError, match=r"register_trust_region\('x'\) needs a TrustRegion subclass, got"):
        register_trust_region("x")(dict)
    assert "x" not in TRUST_REGIONS
    assert register_trust_region("ppo_clip")(PPOClip) is PPOClip  # the same class again: a no-op


@pytest.mark.parametrize(
    "value, error, match",
    [
        (float("nan"), ValueError, "Knob.width must be finite"),
        (float("-inf"), ValueError, "Knob.width must be finite"),
        (True, TypeError, "Knob.width must be a number, got bool"),
        ("0.1", TypeError, "Knob.width must be a number, got str"),
    ],
)
def test_the_base_check_wants_finite_numbers_and_names_the_field(value, error, match):
    @dataclass(frozen=True)
    class Knob(TrustRegion):
        width: float | None = 0.1

    assert Knob(None).width is None and Knob(2).width == 2  # unset optional fields and ints pass
    with pytest.raises(error, match=match):
        Knob(value)


def test_the_base_surrogate_is_abstract():
    with pytest.raises(NotImplementedError):
        TrustRegion().surrogate(None)


def _terms(**over) -> PolicyTerms:
    m = torch.tensor([True, True, False])
    trn = torch.tensor([math.log(0.5), math.log(0.1), math.nan], dtype=torch.float64)
    base = torch.tensor([math.log(0.25), math.log(0.4), math.inf], dtype=torch.float64)
    log_r = torch.where(m, trn - base, 0.0)
    zeros = torch.zeros(3, dtype=torch.float64)
    fields = dict(m=m, trn=trn, base=base, log_r=log_r, r=log_r.exp(), adv=zeros, a=zeros,
                  segments=Segments(torch.zeros(3, dtype=torch.long), 1))  # fmt: skip
    return PolicyTerms(**{**fields, **over})


def test_policy_terms_prob_diff_and_numerator():
    t = _terms()
    # π_θ − π_base on the members; a non-member reads exp(0) − exp(0) = 0 whatever it holds
    assert torch.allclose(t.prob_diff(), torch.tensor([0.25, -0.3, 0.0], dtype=torch.float64), rtol=1e-12)
    assert torch.equal(t.numerator().nan_to_num(), t.trn.nan_to_num())  # no old stream: sg(trn)
    old = torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64)
    assert torch.equal(_terms(old=old).numerator(), old)


def test_selection_streams_read_old_then_rollout_and_shipped_advantages():
    m = torch.tensor([True, False])
    old, rollout = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0])
    assert SelectionStreams(m, None, old, rollout, "old", 1.0).logprobs("X") is old
    assert SelectionStreams(m, None, None, rollout, "old", 1.0).logprobs("X") is rollout
    with pytest.raises(ValueError, match="KLCov reads old_logprobs .*the plan has neither"):
        SelectionStreams(m, None, None, None, "old", 1.0).logprobs("KLCov")
    adv = torch.tensor([0.5, 0.0])
    assert SelectionStreams(m, adv, old, None, "old", 1.0).shipped_advantages("X") is adv
    with pytest.raises(ValueError, match="ClipCov reads the advantages .*advantage='shipped'"):
        SelectionStreams(m, None, old, None, "old", 1.0).shipped_advantages("ClipCov")


def test_a_step_selector_needs_the_engines_selection():
    region = ClipCov()
    with pytest.raises(ValueError, match="ClipCov selects tokens over the step: call it through compute_loss"):
        region.selected(_terms())
    selected = torch.tensor([True, False, True])
    assert region.selected(_terms(selected=selected)).tolist() == [True, False, False]  # members only


@pytest.mark.parametrize("name", sorted(TRUST_REGIONS))
def test_reads_token_ratio_says_whether_the_surrogate_reads_r(name):
    """The flag ``PolicyGradient(ratio_cap=)`` relies on: a region flagged False computes the same
    surrogate whatever ``t.r`` holds; one flagged True changes its loss when the cap binds."""
    region = TRUST_REGIONS[name]()
    streams = with_old(bin_of("hot", seed=11))
    if not region.reads_token_ratio:
        plan = streams.plan(PolicyGradient(region))
        s = streams
        inputs = PolicyInputs(plan.members["rl"], s.trainer_logprobs, s.inference_logprobs, s.old_logprobs,
                              s.ref_logprobs, s.advantages, plan.layout.segments)  # fmt: skip
        t = policy_terms(inputs, PolicyGradient(region))
        garbage = replace(t, r=torch.full_like(t.r, 7.0))
        assert torch.equal(region.surrogate(t).objective, region.surrogate(garbage).objective)
        with pytest.raises(ValueError, match="ratio_cap caps the token ratio r"):
            PolicyGradient(region, ratio_cap=2.0)
        return
    plain = compute_loss(streams.plan(PolicyGradient(region)), streams.outputs()).loss
    capped_objective = PolicyGradient(region, ratio_cap=1.02)
    capped = compute_loss(streams.plan(capped_objective), streams.outputs())
    assert not torch.equal(plain, capped.loss)
    assert 0 < capped.metrics["rl/ratio_capped"].item() < 1
