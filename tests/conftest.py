"""Shared fixtures: the archetypes × prime-rl loss configs, bins in prime-rl's flat layout, the
per-sequence paper-reference check of the objectives and the trust-region families' shared checks."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packloss import (
    REF_KL,
    Component,
    KLPenalty,
    LossResult,
    Outputs,
    Plan,
    PolicyGradient,
    RatioWeightedKL,
    compute_loss,
)
from packloss.compat.prime_rl import DefaultLossConfig, IPOLossConfig
from packloss.testing import ARCHETYPES, OpCounter, Streams, make_archetype, random_seq_lens

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (README, docs/, scripts/)."""
sys.path.insert(0, str(Path(__file__).parent))  # tests/custom_losses.py and conftest are importable
sys.path.insert(0, str(ROOT))  # the peers' test harnesses: tests.integrations.<peer>.harness

CONFIGS = {
    "dppo": DefaultLossConfig(),
    "dppo_high10": DefaultLossConfig(dppo_mask_high=10.0),
    "ipo": IPOLossConfig(),
}


@pytest.fixture(params=ARCHETYPES)
def archetype(request) -> str:
    return request.param


@pytest.fixture(params=sorted(CONFIGS))
def config_name(request) -> str:
    return request.param


def bin_of(archetype: str, num_tokens: int = 257, num_seqs: int = 9, seed: int = 0, **kwargs) -> Streams:
    g = torch.Generator().manual_seed(seed + 1000)
    return make_archetype(archetype, random_seq_lens(num_tokens, num_seqs, g), seed=seed, **kwargs)


def with_old(streams: Streams, seed: int = 0) -> Streams:
    """``streams`` with an old / proximal stream between the rollout's and the trainer's log-probs."""
    g = torch.Generator().manual_seed(seed + 2000)
    inf, trn = streams.inference_logprobs, streams.trainer_logprobs.detach()
    mix = torch.rand(inf.shape, generator=g).to(inf.dtype)
    return streams.replace(old_logprobs=(mix * inf + (1 - mix) * trn).to(inf.device))


def poison_non_members(streams: Streams) -> tuple[Streams, int, int]:
    """Put trn − inf = +100 on one non-member and inf/NaN in unused streams of another token."""
    members = torch.zeros_like(streams.loss_mask)
    for m in streams.masks().values():
        members |= m
    members |= streams.loss_mask
    free = (~members).nonzero().flatten().tolist()
    a, b = free[0], free[-1]
    trn = streams.trainer_logprobs.detach().clone()
    inf = streams.inference_logprobs.clone()
    trn[a], inf[a] = 0.0, -100.0
    adv = streams.advantages.clone()
    adv[b] = float("inf")
    inf[b] = float("nan")
    replaced = dict(trainer_logprobs=trn.requires_grad_(), inference_logprobs=inf, advantages=adv)
    if streams.ref_logprobs is not None:
        ref = streams.ref_logprobs.clone()
        ref[b] = float("nan")
        replaced["ref_logprobs"] = ref
    if streams.old_logprobs is not None:
        old = streams.old_logprobs.clone()
        old[a], old[b] = -100.0, float("nan")
        replaced["old_logprobs"] = old
    if streams.rl_weights is not None:
        rl_w = streams.rl_weights.clone()
        rl_w[b] = float("nan")  # b is outside loss_mask, so it is not an rl member either way
        replaced["rl_weights"] = rl_w
    return streams.replace(**replaced), a, b


# ---------------------------------------------------------------------------------------------------
# Objectives against per-sequence references written from their papers
# ---------------------------------------------------------------------------------------------------


@st.composite
def packings(draw):
    """``(seq_lens, seed, empty, weighted)``: a packing, its data seed, sequences without members."""
    lens = draw(st.lists(st.integers(1, 10), min_size=1, max_size=7))
    seed = draw(st.integers(0, 2**31 - 1))
    empty = draw(st.lists(st.booleans(), min_size=len(lens), max_size=len(lens)))
    weighted = draw(st.booleans())
    return lens, seed, empty, weighted


def draw_bin(lens, seed, empty, weighted) -> SimpleNamespace:
    """Float64 streams of a packing: ``trn`` (a leaf), ``old``, ``inf``, ``ref``, ``adv`` (one value per
    sequence), ``mask`` and ``weights`` (or None). Float64 so both sides agree to 1e-6 without
    float32 summation-order noise."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    p_inf = torch.rand(n, generator=g) * 0.9 + 0.05
    trn = (p_inf * torch.exp((torch.rand(n, generator=g) - 0.5) * 1.2)).clamp(1e-3, 1).log()
    ref = (torch.rand(n, generator=g) * 0.9 + 0.05).log()
    adv = torch.repeat_interleave(torch.randn(len(lens), generator=g), torch.tensor(lens))
    mask = torch.rand(n, generator=g) < 0.8
    seq_ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    mask &= ~torch.tensor(empty)[seq_ids]
    weights = (torch.rand(n, generator=g) * 2).where(torch.rand(n, generator=g) < 0.8, 0.0) if weighted else None
    mix = torch.rand(n, generator=g)
    old = mix * p_inf.log() + (1 - mix) * trn
    f64 = torch.float64
    return SimpleNamespace(
        lens=lens,
        trn=trn.to(f64).requires_grad_(),
        old=old.to(f64),
        inf=p_inf.log().to(f64),
        ref=ref.to(f64),
        adv=adv.to(f64),
        mask=mask,
        weights=None if weights is None else weights.to(f64),
    )


def check_against_paper(objective, paper, case, with_old: bool = False, rtol: float = 1e-6) -> None:
    """The engine's summed loss (``normalize="constant"``, C = 1) and its gradient equal
    ``Σ_i paper(seq_i)`` over the sequences with members, where ``seq_i`` holds that sequence's
    members of ``trn``, ``old`` (None without ``with_old``), ``inf``, ``ref``, ``adv`` and ``w``."""
    b = draw_bin(*case)
    plan = Plan(
        b.lens,
        {"rl": Component(objective, b.mask, b.weights, "constant", 1.0)},
        b.inf,
        b.ref,
        b.adv,
        old_logprobs=b.old if with_old else None,
    )
    members = plan.members["rl"]
    result = compute_loss(plan, Outputs(logprobs=b.trn))
    (grad,) = torch.autograd.grad(result.loss, b.trn)
    expected = b.trn.sum() * 0
    cu = plan.layout.cu_seqlens.tolist()
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        sel = members[start:end]
        if not sel.any():
            continue
        piece = {k: getattr(b, k)[start:end][sel] for k in ("trn", "old", "inf", "ref", "adv")}
        piece["w"] = torch.ones(int(sel.sum()), dtype=torch.float64) if b.weights is None else b.weights[start:end][sel]
        seq = SimpleNamespace(**{**piece, "old": piece["old"] if with_old else None})
        expected = expected + paper(seq)
    (grad_ref,) = torch.autograd.grad(expected, b.trn, allow_unused=True)
    grad_ref = torch.zeros_like(grad) if grad_ref is None else grad_ref
    scale = max(1.0, expected.abs().item())
    assert abs(result.loss.item() - expected.item()) <= rtol * scale, (result.loss.item(), expected.item())
    assert torch.allclose(grad, grad_ref, rtol=rtol, atol=rtol), (grad - grad_ref).abs().max()


# ---------------------------------------------------------------------------------------------------
# The trust-region families (tests/core/trust_regions/test_*.py): one paper reference of the policy
# gradient around each family's regions, NaN safety, no syncs and an op count flat in sequences
# ---------------------------------------------------------------------------------------------------

NORMALIZE_MODES = ("token", "position", "sequence_mean", "sequence_sum", "constant", "group_mean")


def drift(coef: float, estimator: str = "squared_log_ratio") -> tuple[KLPenalty, ...]:
    return (KLPenalty(coef, estimator, "rollout"),)


def estimator(kind: str, x: torch.Tensor) -> torch.Tensor:
    return {"squared_log_ratio": x**2, "k1": -x, "k2": x**2 / 2, "k3": x.exp() - x - 1}[kind]


def paper_sequence_loss(seq, p: PolicyGradient, base: str, papers: dict) -> torch.Tensor:
    """One sequence's summed loss over its members, from the papers' formulas. ``base`` is the ratio's
    denominator (``"inf"``, ``"old"`` or ``"sg"``: on-policy); ``papers[region name](tr, trn, denominator,
    a, adv)`` is the region's objective ``J`` (``adv`` the raw advantage, ``a = adv_coef · adv``)."""
    trn, inf, ref = seq.trn, seq.inf, seq.ref
    denominator = {"inf": inf, "old": seq.old, "sg": trn.detach()}[base]
    adv = (ref - trn).detach() if p.advantage == "ref_kl" else seq.adv
    a = p.adv_coef * adv
    tr = p.trust_region
    loss = -papers[tr.name](tr, trn, denominator, a, adv)
    for k in p.penalties:
        x = {"ref": ref - trn, "rollout": trn - inf, "old": trn - (seq.old if seq.old is not None else inf)}[k.against]
        loss = loss + k.coef * estimator(k.estimator, x)
    return (loss * seq.w).sum()


def check_objective_against_paper(objective: PolicyGradient, base: str, papers: dict, case) -> None:
    """:func:`check_against_paper` of ``objective`` with :func:`paper_sequence_loss` as the reference."""
    paper = lambda seq: paper_sequence_loss(seq, objective, base, papers)
    check_against_paper(objective, paper, case, with_old=base == "old")


def check_nan_safe(rl, old: bool, ref_kl=REF_KL) -> None:
    """Extremes, inf and NaN on non-members change neither the loss, nor its gradient, nor a metric."""
    clean = bin_of("sdft", seed=2)
    clean = with_old(clean) if old else clean
    poisoned, _, _ = poison_non_members(clean)
    out_clean = compute_loss(clean.plan(rl, ref_kl), clean.outputs())
    out_poisoned = compute_loss(poisoned.plan(rl, ref_kl), poisoned.outputs())
    (g_clean,) = torch.autograd.grad(out_clean.loss, clean.trainer_logprobs)
    (g_poisoned,) = torch.autograd.grad(out_poisoned.loss, poisoned.trainer_logprobs)
    assert torch.isfinite(g_poisoned).all() and torch.isfinite(out_poisoned.loss)
    assert torch.equal(out_clean.loss, out_poisoned.loss)
    assert torch.equal(g_clean, g_poisoned)
    for key, value in out_clean.metrics.items():
        assert torch.equal(value, out_poisoned.metrics[key]), key


def check_sync_free_and_flat(rl, mode: str, old: bool, ref_kl=REF_KL, grouped: bool = True) -> None:
    """Forward and backward with ``normalize=mode`` read no device value on the host, and run the same
    number of aten ops for 1, 16 and 256 sequences (``grouped``: the plan carries group ids)."""
    totals = set()
    for num_seqs in (1, 16, 256):
        streams = bin_of("sdft", num_tokens=1024, num_seqs=num_seqs, seed=3)
        streams = with_old(streams) if old else streams
        constants = {"rl": 1000.0, "ref_kl": 10.0} if mode == "constant" else None
        groups = [s // 3 for s in range(num_seqs)] if grouped else None
        plan = streams.plan(rl, ref_kl, normalize=mode, constants=constants, group_ids=groups)
        with OpCounter() as counter:
            compute_loss(plan, streams.outputs(), per_sequence_metrics=True).loss.backward()
        assert counter.num_syncs == 0, counter.syncs
        totals.add(counter.total)
    assert len(totals) == 1, totals


def one_bin(region, log_r, adv, lens=None, base=-1.0):
    """A single-component plan over ``log_r`` against π_rollout (all members), float64: ``(out, grad)``
    of the summed loss (``normalize="constant"``, C = 1)."""
    n = len(log_r)
    trn = (torch.tensor(log_r, dtype=torch.float64) + base).requires_grad_()
    members = torch.ones(n, dtype=torch.bool)
    component = Component(PolicyGradient(region, ratio="rollout"), members, None, "constant", 1.0)
    inf = torch.full((n,), base, dtype=torch.float64)
    plan = Plan(lens or [n], {"rl": component}, inf, advantages=torch.tensor(adv, dtype=torch.float64))
    out = compute_loss(plan, Outputs(logprobs=trn))
    (grad,) = torch.autograd.grad(out.loss, trn)
    return out, grad


# ---------------------------------------------------------------------------------------------------
# Small bins for the components' own tests
# ---------------------------------------------------------------------------------------------------


def toy(n: int = 12, seed: int = 0):
    """``(generator, seq_lens, inference, trainer, mask)`` of a 12-token bin of three sequences."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [5, 1, 6]
    inference = torch.rand(n, generator=g).clamp_min(0.05).log()
    trainer = (inference + 0.1 * torch.randn(n, generator=g)).clamp_max(0).requires_grad_()
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
    return g, seq_lens, inference, trainer, mask


def one_sequence(loss, trn, inf, ref, adv, mask, w=None) -> LossResult:
    """One sequence through the engine with the summed loss (``constant`` 1): ``Σ_t w_t ℓ_t``."""
    plan = Plan([trn.shape[0]], {"rl": Component(loss, mask, w, "constant", 1.0)}, inf, ref, adv)
    return compute_loss(plan, Outputs(logprobs=trn))


# ---------------------------------------------------------------------------------------------------
# ``packloss bench loss --quick``, run once per test process (tests/tools/test_cli.py, tests/tools/bench/)
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory) -> tuple[int, Path, str]:
    """One in-process ``packloss bench loss --quick`` (the compiled column on the hot path included):
    ``(exit code, out dir, results.json text)``."""
    from packloss.tools.cli import main

    out = tmp_path_factory.mktemp("bench")
    threads = torch.get_num_threads()
    try:
        code = main(["bench", "loss", "--quick", "--out", str(out), "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    return code, out, (out / "results.json").read_text()


def demo_rollouts() -> list:
    """Three rollouts of the demo's task (prompts of 3, 8 and 4 digits; completions of 4, 3 and 6 tokens)."""
    from packloss.tools import demo

    out = []
    for digits, completion in (("123", [7, 6, 5, 3]), ("98765432", [5, 6, 3]), ("4444", [8, 8, 8, 8, 8, 8])):
        out.append(demo.Rollout(digits, demo.encode_prompt(digits), completion, [0.0] * len(completion), 0.0, False))
    return out


def region_family_tests(objectives: dict, papers: dict, regions: dict | None = None) -> dict:
    """The tests every trust-region family file runs, as ``{name: test function}`` for its ``globals()``:
    each objective of ``objectives`` (``name → (PolicyGradient, base)``) against its per-sequence paper
    reference in ``papers`` (200 hypothesis packings), NaN-safe on non-members, sync-free and flat in the
    sequences under every mode; ``regions`` (``name → (TrustRegion, reference)``, ratios against π_old)
    likewise, alone and beside the ratio-weighted KL."""
    many = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

    @pytest.mark.parametrize("name", sorted(objectives))
    @many
    @given(case=packings())
    def test_objective_matches_paper_reference(name, case):
        objective, base = objectives[name]
        check_objective_against_paper(objective, base, papers, case)

    @pytest.mark.parametrize("name", sorted(objectives))
    def test_objective_is_nan_safe(name):
        params, base = objectives[name]
        check_nan_safe(params, old=base == "old")

    @pytest.mark.parametrize("name", sorted(objectives))
    @pytest.mark.parametrize("mode", NORMALIZE_MODES)
    def test_objective_and_mode_sync_free_and_flat(name, mode):
        params, base = objectives[name]
        check_sync_free_and_flat(params, mode, old=base == "old")

    tests = dict(
        test_objective_matches_paper_reference=test_objective_matches_paper_reference,
        test_objective_is_nan_safe=test_objective_is_nan_safe,
        test_objective_and_mode_sync_free_and_flat=test_objective_and_mode_sync_free_and_flat,
    )
    if not regions:
        return tests
    modules = {f"pg_{k}": (PolicyGradient(region), RatioWeightedKL(0.04)) for k, (region, _) in regions.items()}

    @pytest.mark.parametrize("name", sorted(regions))
    @many
    @given(case=packings())
    def test_region_matches_paper_reference(name, case):
        region, paper = regions[name]
        check_against_paper(PolicyGradient(region), paper, case, with_old=True, rtol=1e-9)

    return (
        tests
        | module_part_tests(modules)
        | dict(test_region_matches_paper_reference=test_region_matches_paper_reference)
    )


def module_part_tests(modules: dict) -> dict:
    """``modules`` (``name → (rl objective, kl objective)``, the parts of one trainer module) NaN-safe on
    non-members, sync-free and flat in the sequences, as ``{name: test function}`` for ``globals()``."""

    @pytest.mark.parametrize("name", sorted(modules))
    def test_module_parts_are_nan_safe(name):
        rl, kl = modules[name]
        check_nan_safe(rl, old=True, ref_kl=kl)

    @pytest.mark.parametrize("name", sorted(modules))
    @pytest.mark.parametrize("mode", ["token", "sequence_mean", "constant"])
    def test_module_parts_sync_free_and_flat(name, mode):
        rl, kl = modules[name]
        check_sync_free_and_flat(rl, mode, old=True, ref_kl=kl, grouped=False)

    return dict(
        test_module_parts_are_nan_safe=test_module_parts_are_nan_safe,
        test_module_parts_sync_free_and_flat=test_module_parts_sync_free_and_flat,
    )
