"""FusedObjective: the head and the objective in one pass, against the two-step path written plainly
(materialised float64 log-softmax, then the objective on its log-probs and entropy)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from packloss import (
    DPPO,
    IPO,
    REF_KL,
    SFT,
    TRUST_REGIONS,
    Component,
    Entropy,
    GatedCorrection,
    KLPenalty,
    OffPolicyMask,
    Outputs,
    Plan,
    PolicyGradient,
    RatioWeightedKL,
    RolloutCorrection,
    compute_loss,
)
from packloss.testing import OpCounter
from packloss.vocab import FusedObjective

SEQ_LENS = (7, 1, 12, 5, 9, 6)
N, H, V = sum(SEQ_LENS), 8, 37
GROUPS = [0, 0, 0, 1, 1, 1]

OBJECTIVES = {
    **{f"pg_{name}": PolicyGradient(name) for name in sorted(TRUST_REGIONS)},
    "pg_rollout_ratio": PolicyGradient("ppo_clip", ratio="rollout"),
    "pg_ref_kl_advantage": REF_KL,
    "pg_ratio_cap": PolicyGradient("ppo_clip", ratio_cap=1.1),
    "pg_penalties": PolicyGradient(
        penalties=(KLPenalty(0.1, "k1", "ref"), KLPenalty(0.05, "k3", "rollout"), KLPenalty(0.2, "k2", "old"))
    ),
    "pg_token_correction": PolicyGradient(correction=RolloutCorrection("token", high=1.5)),
    "pg_sequence_correction": PolicyGradient(correction=RolloutCorrection("sequence", high=1.5)),
    "pg_sequence_correction_no_old": PolicyGradient(correction=RolloutCorrection("sequence", high=1.5)),
    "pg_gated_correction": PolicyGradient(correction=GatedCorrection(high=1.5)),
    "pg_off_policy_mask": PolicyGradient(off_policy_mask=OffPolicyMask(0.01)),
    "dppo": DPPO,
    "ipo": IPO,
    "ratio_weighted_kl_token": RatioWeightedKL(0.1),
    "ratio_weighted_kl_sequence": RatioWeightedKL(0.1, level="sequence"),
    "sft": SFT(),
    "entropy": Entropy(0.01),
}
NO_OLD = {"pg_sequence_correction_no_old"}


def _streams(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    trn = torch.rand(N, generator=g, dtype=torch.float64).clamp(0.05).log()
    drift = lambda: trn + (torch.rand(N, generator=g, dtype=torch.float64) - 0.5) * 0.8
    mask = torch.rand(N, generator=g) < 0.75
    mask[SEQ_LENS[0]] = True  # the length-1 sequence is a completion token
    adv = torch.repeat_interleave(torch.randn(len(SEQ_LENS), generator=g, dtype=torch.float64), torch.tensor(SEQ_LENS))
    return {"rollout": drift(), "ref": drift(), "old": drift(), "adv": adv, "mask": mask}


def _plan(name: str, objective, streams: dict, normalize: str = "token") -> Plan:
    return Plan(
        seq_lens=SEQ_LENS,
        components={"c": Component(objective, streams["mask"], None, normalize)},
        rollout_logprobs=streams["rollout"],
        ref_logprobs=streams["ref"],
        old_logprobs=None if name in NO_OLD else streams["old"],
        advantages=streams["adv"],
        group_ids=GROUPS,
    )


def _head(seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, labels


def _plain_head(hidden, weight, labels, temperature=1.0, softcap=None):
    """Log-probs and entropy from the materialised ``[N, V]`` logits (float64)."""
    z = hidden.double() @ weight.double().T
    x = (z if softcap is None else softcap * torch.tanh(z / softcap)) / temperature
    log_p = torch.log_softmax(x, -1)
    return log_p.gather(1, labels[:, None]).squeeze(1), -(log_p.exp() * log_p).sum(-1)


def _grads_wrt_outputs(plan: Plan, lp: torch.Tensor, ent: torch.Tensor):
    lp, ent = lp.clone().requires_grad_(), ent.clone().requires_grad_()
    loss = compute_loss(plan, Outputs(logprobs=lp, entropy=ent)).loss
    g_lp, g_ent = torch.autograd.grad(loss, (lp, ent), allow_unused=True)
    return (torch.zeros_like(lp) if g_lp is None else g_lp), (torch.zeros_like(ent) if g_ent is None else g_ent)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_token_local_says_whether_a_token_gradient_reads_other_tokens(name):
    """The flag against a perturbation: move one member's log-prob and entropy, and a token-local
    objective's gradient at every other token stays exactly where it was; a non-local one moves somewhere."""
    streams = _streams(0)
    plan = _plan(name, OBJECTIVES[name], streams)
    g = torch.Generator().manual_seed(5)
    lp = torch.rand(N, generator=g, dtype=torch.float64).clamp(0.05).log()
    ent = torch.rand(N, generator=g, dtype=torch.float64) * 3
    g_lp, g_ent = _grads_wrt_outputs(plan, lp, ent)
    moved = False
    for s in torch.nonzero(streams["mask"]).flatten().tolist():
        for step in (0.4, -3.0, 3.0):  # large steps too: a sequence gate moves only past its threshold
            lp2, ent2 = lp.clone(), ent.clone()
            lp2[s] += step
            ent2[s] += abs(step)
            h_lp, h_ent = _grads_wrt_outputs(plan, lp2, ent2)
            others = torch.arange(N) != s
            moved |= not (torch.equal(h_lp[others], g_lp[others]) and torch.equal(h_ent[others], g_ent[others]))
    assert moved != OBJECTIVES[name].token_local(plan), f"{name}: token_local={OBJECTIVES[name].token_local(plan)}"


CASES = [
    ("token", 1.0, None, None),
    ("sequence_mean", 0.7, None, 5),
    ("token", 1.3, 2.5, 4),
    ("group_mean", 1.0, 3.0, 64),
]


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@pytest.mark.parametrize("normalize,temperature,softcap,chunk", CASES)
def test_fused_equals_the_two_step_path(name, normalize, temperature, softcap, chunk):
    streams = _streams(1)
    objective = OBJECTIVES[name]
    hidden, weight, labels = _head(1)
    fused = FusedObjective(objective, temperature=temperature, softcap=softcap, chunk_size=chunk)
    outputs = Outputs(hidden=hidden, head_weight=weight, labels=labels)
    got = compute_loss(_plan(name, fused, streams, normalize), outputs)
    got_h, got_w = torch.autograd.grad(got.loss, (hidden, weight))

    lp, ent = _plain_head(hidden, weight, labels, temperature, softcap)
    want = compute_loss(_plan(name, objective, streams, normalize), Outputs(logprobs=lp, entropy=ent))
    want_h, want_w = torch.autograd.grad(want.loss, (hidden, weight))
    assert fused.one_pass(_plan(name, fused, streams)) == objective.token_local(_plan(name, objective, streams))
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_h, want_h, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(got_w, want_w, rtol=1e-10, atol=1e-13)
    assert got.metrics.keys() == want.metrics.keys()
    for key in want.metrics:
        torch.testing.assert_close(got.metrics[key], want.metrics[key], rtol=1e-10, atol=1e-13, msg=key)
    torch.testing.assert_close(got.per_token["c"], want.per_token["c"], rtol=1e-10, atol=1e-13)


class _MatmulFlops(TorchDispatchMode):
    """``2·m·k·n`` summed over every ``mm`` / ``addmm`` (in place and ``out=`` included, which
    torch's FlopCounterMode leaves out)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_"):
            a, b = (args[0], args[1]) if name == "mm" else (args[1], args[2])
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


def test_one_pass_takes_three_head_matmuls_and_the_two_step_path_four():
    streams = _streams(2)
    hidden, weight, labels = _head(2)
    outputs = Outputs(hidden=hidden, head_weight=weight, labels=labels)
    head_flops = 2 * N * H * V
    for objective, matmuls in ((PolicyGradient("ppo_clip"), 3), (PolicyGradient("gspo"), 4)):
        plan = _plan("x", FusedObjective(objective, chunk_size=7), streams)
        with _MatmulFlops() as counted:
            loss = compute_loss(plan, outputs).loss
            loss.backward()
        assert counted.flops == matmuls * head_flops, type(objective.trust_region).__name__


def test_one_pass_is_sync_free():
    streams = _streams(3)
    hidden, weight, labels = _head(3, torch.float32)
    plan = _plan("x", FusedObjective(PolicyGradient("ppo_clip", penalties=(KLPenalty(0.1),)), chunk_size=9), streams)
    with OpCounter() as ops:
        loss = compute_loss(plan, Outputs(hidden=hidden, head_weight=weight, labels=labels)).loss
        loss.backward()
    assert ops.num_syncs == 0, dict(ops.syncs)


@pytest.mark.parametrize("objective", [PolicyGradient("ppo_clip"), PolicyGradient("gspo")], ids=["one", "two_step"])
def test_non_members_may_hold_anything(objective):
    streams = _streams(4)
    hidden, weight, labels = _head(4)
    plan = _plan("x", FusedObjective(objective, chunk_size=6), streams)
    clean = compute_loss(plan, Outputs(hidden=hidden, head_weight=weight, labels=labels)).loss
    want = torch.autograd.grad(clean, (hidden, weight))
    off = ~streams["mask"]
    poisoned_h = torch.where(off[:, None], float("nan"), hidden.detach()).requires_grad_()
    poisoned = compute_loss(
        plan, Outputs(hidden=poisoned_h, head_weight=weight, labels=torch.where(off, -100, labels))
    ).loss
    got = torch.autograd.grad(poisoned, (poisoned_h, weight))
    torch.testing.assert_close(poisoned, clean, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got[0][~off], want[0][~off], rtol=1e-12, atol=1e-14)
    assert torch.equal(got[0][off], torch.zeros_like(got[0][off]))


def test_low_precision_inputs_compute_in_float32():
    streams = {k: v.float() if v.is_floating_point() else v for k, v in _streams(5).items()}
    hidden, weight, labels = _head(5, torch.bfloat16)
    plan = _plan("x", FusedObjective(PolicyGradient("ppo_clip")), streams)
    got = compute_loss(plan, Outputs(hidden=hidden, head_weight=weight, labels=labels))
    g_h, g_w = torch.autograd.grad(got.loss, (hidden, weight))
    lp, ent = _plain_head(hidden.float(), weight.float(), labels)
    plain = Outputs(logprobs=lp.float(), entropy=ent.float())
    want = compute_loss(_plan("x", PolicyGradient("ppo_clip"), streams), plain)
    assert got.loss.dtype == torch.float32 and g_h.dtype == torch.bfloat16 and g_w.dtype == torch.bfloat16
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-4, atol=1e-5)


def test_gradient_of_the_gradient_raises():
    streams = _streams(6)
    hidden, weight, labels = _head(6)
    plan = _plan("x", FusedObjective(SFT()), streams)
    loss = compute_loss(plan, Outputs(hidden=hidden, head_weight=weight, labels=labels)).loss
    with pytest.raises(RuntimeError, match="first order"):
        torch.autograd.grad(loss, hidden, create_graph=True)


def test_bad_arguments_name_what_was_wrong():
    with pytest.raises(TypeError, match="objective must be an Objective"):
        FusedObjective("ppo_clip")
    with pytest.raises(TypeError, match="not be a FusedObjective"):
        FusedObjective(FusedObjective(SFT()))
    with pytest.raises(ValueError, match="temperature"):
        FusedObjective(SFT(), temperature=0.0)
    with pytest.raises(ValueError, match="softcap"):
        FusedObjective(SFT(), softcap=-1.0)
    with pytest.raises(ValueError, match="chunk_size"):
        FusedObjective(SFT(), chunk_size=0)
    streams = _streams(7)
    hidden, weight, labels = _head(7)
    plan = _plan("x", FusedObjective(SFT()), streams)
    with pytest.raises(ValueError, match="outputs.labels"):
        compute_loss(plan, Outputs(hidden=hidden, head_weight=weight))
    with pytest.raises(TypeError, match="outputs.labels must be an integer"):
        Outputs(hidden=hidden, head_weight=weight, labels=labels.double())
    with pytest.raises(ValueError, match="outputs.labels must have shape"):
        compute_loss(plan, Outputs(hidden=hidden, head_weight=weight, labels=labels[1:]))
