"""packloss.core.preference: DPO (sigmoid, cDPO, robust, hinge, IPO), SimPO and ORPO on packed bins.

The step's loss, gradient and metrics equal the installed peers' own code on the same pairs padded:
OpenRLHF 0.11.2's ``DPOLoss`` (sigmoid, cDPO label smoothing, IPO on sums); TRL 1.16's
``DPOTrainer._compute_loss`` (sigmoid, robust, hinge, ipo, sigmoid_norm, and ``["sigmoid", "sft"]``
with weights), its experimental ``CPOTrainer`` (simpo, with and without the NLL) and ``ORPOTrainer``
(``get_batch_loss_metrics``: odds ratio + NLL). TRL's methods run unbound on a stand-in ``self``
(``types.SimpleNamespace`` with the attributes they read) and a stand-in model: for DPO it returns the
fused head's per-token log-probs (zero where the label is ``-100``, as TRL's head), for CPO/ORPO
two-class logits whose log-softmax at label 0 is exactly the token's log-prob. packloss runs the
pairs packed: several pairs per bin, their sequences in any order, several bins with step
denominators. Also: per-pair paper formulas over 200 hypothesis packings, open-instruct #1900's bug
class, the host pair checks, NaN safety, float32 compute, flat op counts, no sync, a context-parallel
bin, and the snippet of ``docs/preference.md``.
"""

from __future__ import annotations

import math
import random
import re
import types
from collections import defaultdict
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor
from trl.experimental.cpo.cpo_trainer import CPOTrainer
from trl.experimental.orpo.orpo_trainer import ORPOTrainer
from trl.trainer.dpo_trainer import DPOTrainer

from conftest import ROOT
from packloss import SFT, Component, Outputs, Plan, compute_loss, count_denominators, merge_metrics
from packloss.core.preference import DPO, ORPO, SimPO
from packloss.testing import OpCounter
from packloss.testing.dist import run_gloo, run_program
from tests.integrations.openrlhf.harness import ORL, needs_openrlhf

F64 = torch.float64
RTOL = 1e-10
ATOL = 1e-12


# ---------------------------------------------------------------------------------------------------
# Pairs, packed into bins and padded as the peers take them
# ---------------------------------------------------------------------------------------------------


@dataclass
class Seq:
    """One sequence: its pair, chosen or not, ``prompt`` tokens (non-members) then its completion;
    ``trn`` / ``ref`` per-token log-probs (the first token, never scored, holds NaN)."""

    pair: int
    chosen: bool
    prompt: int
    trn: Tensor
    ref: Tensor

    @property
    def length(self) -> int:
        return self.trn.numel()


def make_seqs(num_pairs: int, seed: int, completion: tuple[int, int] = (1, 7)) -> list[Seq]:
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for p in range(num_pairs):
        for chosen in (True, False):
            prompt = int(torch.randint(1, 4, (1,), generator=g))
            n = prompt + int(torch.randint(completion[0], completion[1] + 1, (1,), generator=g))
            trn = (torch.rand(n, generator=g, dtype=F64) * 0.9 + 0.05).log()
            ref = (torch.rand(n, generator=g, dtype=F64) * 0.9 + 0.05).log()
            trn[0] = ref[0] = float("nan")
            seqs.append(Seq(p, chosen, prompt, trn, ref))
    return seqs


@dataclass
class Packed:
    """The bins: ``plans``, their trainer log-prob leaves, and where each sequence lies."""

    plans: list[Plan]
    leaves: list[Tensor]
    spans: dict[tuple[int, bool], tuple[int, int, int]]

    def values(self, pair: int, chosen: bool) -> Tensor:
        """The sequence's trainer log-probs, a differentiable slice of its bin's leaf."""
        k, start, end = self.spans[pair, chosen]
        return self.leaves[k][start:end]

    def step(self, **kwargs) -> tuple[Tensor, dict[str, Tensor]]:
        """The step's loss (the bins' losses summed, with step denominators) and merged metrics."""
        den = count_denominators(self.plans)
        results = [
            compute_loss(p, Outputs(logprobs=x), den, **kwargs) for p, x in zip(self.plans, self.leaves, strict=True)
        ]
        return sum(r.loss for r in results), merge_metrics(results)[0]


def pack(seqs: list[Seq], num_bins: int, components, seed: int, dtype=F64) -> Packed:
    """Pairs spread over ``num_bins`` bins, each bin's sequences shuffled. ``components(tokens)`` builds a
    bin's components from its tokens' ``mask`` (completions), ``chosen`` (chosen sequences), ``scored``
    (every token but each sequence's first) and ``pair`` (the pair id), ``[N]`` each."""
    rng = random.Random(seed)
    pairs = sorted({s.pair for s in seqs})
    rng.shuffle(pairs)
    cuts = sorted(rng.sample(range(1, len(pairs)), num_bins - 1)) if num_bins > 1 else []
    groups = [pairs[a:b] for a, b in zip([0, *cuts], [*cuts, len(pairs)], strict=True)]
    plans, leaves, spans = [], [], {}
    for k, group in enumerate(groups):
        members = [s for s in seqs if s.pair in group]
        rng.shuffle(members)
        start = 0
        for s in members:
            spans[s.pair, s.chosen] = (k, start, start + s.length)
            start += s.length
        tokens = types.SimpleNamespace(
            mask=torch.cat([torch.arange(s.length) >= s.prompt for s in members]),
            chosen=torch.cat([torch.full((s.length,), s.chosen) for s in members]),
            scored=torch.cat([torch.arange(s.length) > 0 for s in members]),
            pair=torch.cat([torch.full((s.length,), s.pair) for s in members]),
        )
        plans.append(
            Plan(
                [s.length for s in members],
                components(tokens),
                ref_logprobs=torch.cat([s.ref for s in members]).to(dtype),
                group_ids=[s.pair for s in members],
                chosen=[s.chosen for s in members],
            )
        )
        leaves.append(torch.cat([s.trn for s in members]).to(dtype).requires_grad_())
    return Packed(plans, leaves, spans)


def rows(packed: Packed, seqs: list[Seq]) -> tuple[list[Tensor], list[Tensor], list[int]]:
    """The peers' row order (every chosen sequence, then every rejected one, pair by pair): trainer
    log-probs (from the bins' leaves), reference log-probs and prompt lengths."""
    by = {(s.pair, s.chosen): s for s in seqs}
    order = [(p, c) for c in (True, False) for p in range(len(seqs) // 2)]
    trn = [packed.values(*key) for key in order]
    return trn, [by[key].ref for key in order], [by[key].prompt for key in order]


def padded(values: list[Tensor], fill: float = 0.0) -> Tensor:
    """Right-padded ``[R, T]``."""
    t = max(v.numel() for v in values)
    return torch.stack([F.pad(v, (0, t - v.numel()), value=fill) for v in values])


def completion_mask(values: list[Tensor], prompts: list[int]) -> tuple[Tensor, Tensor]:
    """``(attention [R, T], completion [R, T])`` bool."""
    t = max(v.numel() for v in values)
    pos = torch.arange(t)
    lens = torch.tensor([v.numel() for v in values])
    attention = pos < lens[:, None]
    return attention, attention & (pos >= torch.tensor(prompts)[:, None])


def completion_sums(values: list[Tensor], prompts: list[int]) -> Tensor:
    """Per row, the summed log-probs of the completion tokens (a padded masked sum).  ``[R]``."""
    _, comp = completion_mask(values, prompts)
    return torch.where(comp, padded(values), 0.0).sum(1)


def grads(loss: Tensor, leaves: list[Tensor]) -> list[Tensor]:
    return list(torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True))


def assert_same_step(loss: Tensor, expected: Tensor, leaves: list[Tensor], rtol: float = RTOL) -> None:
    torch.testing.assert_close(loss.detach(), expected.detach().to(loss.dtype), rtol=rtol, atol=ATOL)
    for got, want in zip(grads(loss, leaves), grads(expected, leaves), strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=rtol, atol=ATOL)


def preference(objective, normalize: str = "group_mean", **extra):
    """``components`` for :func:`pack`: the objective on the completion tokens, plus ``extra``."""

    def build(t):
        return {"pref": Component(objective, mask=t.mask, normalize=normalize), **{k: f(t) for k, f in extra.items()}}

    return build


_ACCELERATOR = types.SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x)


# ---------------------------------------------------------------------------------------------------
# OpenRLHF's DPOLoss
# ---------------------------------------------------------------------------------------------------


@needs_openrlhf
@pytest.mark.parametrize(
    ("objective", "peer"),
    [
        (DPO(beta=0.1), dict(beta=0.1)),
        (DPO(beta=0.5, label_smoothing=0.2), dict(beta=0.5, label_smoothing=0.2)),
        (DPO(beta=0.3, loss_type="ipo", average_log_prob=False), dict(beta=0.3, ipo=True)),
    ],
    ids=["sigmoid", "cdpo", "ipo_sums"],
)
@pytest.mark.parametrize("normalize", ["group_mean", "sequence_mean"])
def test_dpo_equals_openrlhf_dpo_loss(objective, peer, normalize):
    seqs = make_seqs(7, seed=1)
    packed = pack(seqs, 3, preference(objective, normalize), seed=2)
    loss, metrics = packed.step()
    trn, ref, prompts = rows(packed, seqs)
    pi, rf = completion_sums(trn, prompts), completion_sums(ref, prompts)
    b = len(seqs) // 2
    expected, chosen_reward, rejected_reward = ORL.DPOLoss(**peer)(pi[:b], pi[b:], rf[:b], rf[b:])
    assert_same_step(loss, expected, packed.leaves)
    torch.testing.assert_close(metrics["pref/rewards/chosen"], chosen_reward.mean(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(metrics["pref/rewards/rejected"], rejected_reward.mean(), rtol=RTOL, atol=ATOL)
    accuracy = (chosen_reward > rejected_reward).to(F64).mean()  # OpenRLHF's DPO trainer's "acc"
    torch.testing.assert_close(metrics["pref/rewards/accuracies"], accuracy)


# ---------------------------------------------------------------------------------------------------
# TRL's DPOTrainer._compute_loss
# ---------------------------------------------------------------------------------------------------


def trl_dpo(trn, ref, prompts, *, loss_types, beta, label_smoothing=0.0, loss_weights=None):
    """TRL 1.16's ``DPOTrainer._compute_loss`` on the padded rows, with precomputed reference sums:
    ``(loss, {metric: value})``."""
    attention, comp = completion_mask(trn, prompts)
    values = padded(trn)
    ref_sums = completion_sums(ref, prompts)
    b = len(trn) // 2

    def model(input_ids, attention_mask, labels, fused_lm_head, use_cache):
        scored = labels[:, 1:] != -100
        lp = torch.where(scored, values[:, 1:], 0.0)  # TRL's fused head: log-probs, 0 where the label is -100
        zeros = torch.zeros_like(lp)
        return types.SimpleNamespace(log_probs=lp, entropy=zeros, mean_logits=zeros, is_top1=scored, aux_loss=None)

    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=_ACCELERATOR, aux_loss_enabled=False,
        ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=loss_types,
        loss_weights=loss_weights or [1.0] * len(loss_types), beta=beta, label_smoothing=label_smoothing,
        use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
        args=types.SimpleNamespace(),
    )  # fmt: skip
    inputs = {
        "input_ids": torch.zeros(values.shape, dtype=torch.long),
        "attention_mask": attention.long(),
        "completion_mask": comp.long(),
        "ref_chosen_logps": ref_sums[:b],
        "ref_rejected_logps": ref_sums[b:],
    }
    loss = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


TRL_METRICS = (
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
)  # fmt: skip


def assert_metrics(metrics: dict[str, Tensor], peer: dict[str, float], names, rel: float) -> None:
    """packloss's ``pref/<name>`` against the peer's ``<name>`` (accuracies: TRL's are float32)."""
    for name in names:
        tol = max(rel, 1e-7) if name == "rewards/accuracies" else rel
        assert metrics[f"pref/{name}"].item() == pytest.approx(float(peer[name]), rel=tol, abs=1e-12), name


@pytest.mark.parametrize(
    ("objective", "trl_type", "smoothing"),
    [
        (DPO(beta=0.2), "sigmoid", 0.0),
        (DPO(beta=0.2, loss_type="robust", label_smoothing=0.15), "robust", 0.15),
        (DPO(beta=0.4, loss_type="hinge"), "hinge", 0.0),
        (DPO(beta=0.3, loss_type="ipo"), "ipo", 0.0),
        (DPO(beta=0.5, average_log_prob=True), "sigmoid_norm", 0.0),
    ],
    ids=["sigmoid", "robust", "hinge", "ipo", "sigmoid_norm"],
)
def test_dpo_equals_trl_dpo_trainer(objective, trl_type, smoothing):
    seqs = make_seqs(6, seed=3)
    packed = pack(seqs, 2, preference(objective), seed=4)
    loss, metrics = packed.step()
    trn, ref, prompts = rows(packed, seqs)
    expected, trl_metrics = trl_dpo(trn, ref, prompts, loss_types=[trl_type], beta=objective.beta,
                                    label_smoothing=smoothing)  # fmt: skip
    assert_same_step(loss, expected, packed.leaves)
    assert_metrics(metrics, trl_metrics, TRL_METRICS, rel=1e-10)
    assert metrics["pref/loss"].item() == pytest.approx(expected.item(), rel=1e-10)  # the mean over pairs


def test_dpo_with_an_sft_component_equals_trl_sigmoid_plus_sft():
    """TRL's ``loss_type=["sigmoid", "sft"]`` with ``loss_weights``: two packloss components, the NLL
    a token mean over the chosen completions (``SFT``, ``normalize="token"``), each weighted."""
    seqs = make_seqs(5, seed=5)
    w_dpo, w_sft = 0.8, 0.3

    def components(t):
        return {
            "dpo": Component(DPO(beta=0.1), t.mask, torch.full(t.mask.shape, w_dpo, dtype=F64), "group_mean"),
            "sft": Component(SFT(), t.mask & t.chosen, torch.full(t.mask.shape, w_sft, dtype=F64), "token"),
        }

    packed = pack(seqs, 2, components, seed=6)
    loss, metrics = packed.step()
    trn, ref, prompts = rows(packed, seqs)
    expected, _ = trl_dpo(trn, ref, prompts, loss_types=["sigmoid", "sft"], beta=0.1, loss_weights=[w_dpo, w_sft])
    assert_same_step(loss, expected, packed.leaves)


# ---------------------------------------------------------------------------------------------------
# TRL's CPOTrainer (simpo) and ORPOTrainer, through their own get_batch_logps and loss methods
# ---------------------------------------------------------------------------------------------------


def two_class_logits(values: Tensor) -> Tensor:
    """``[R, T, 2]`` logits whose log-softmax at class 0, position ``j``, is ``values[:, j + 1]`` (the
    next token's log-prob; label id 0); the last position predicts nothing."""
    nxt = torch.cat([values[:, 1:], torch.full_like(values[:, :1], -1.0)], dim=1)
    other = torch.log(torch.expm1(-nxt))
    return torch.stack([torch.zeros_like(nxt), other], dim=-1)


def trl_pair_batch(trn: list[Tensor], prompts: list[int]):
    """The padded CPO/ORPO batch (``chosen_*`` / ``rejected_*``: ids 0, labels -100 off the completion)
    and a stand-in model returning :func:`two_class_logits` of the rows, in TRL's concatenated order."""
    b = len(trn) // 2
    attention, comp = completion_mask(trn, prompts)
    values = torch.where(attention, padded(trn, -1.0), -1.0).nan_to_num(-1.0)  # first tokens are never predicted
    batch = {}
    for half, rows_ in (("chosen", slice(0, b)), ("rejected", slice(b, None))):
        batch[f"{half}_input_ids"] = torch.zeros(comp[rows_].shape, dtype=torch.long)
        batch[f"{half}_attention_mask"] = attention[rows_].long()
        batch[f"{half}_labels"] = torch.where(comp[rows_], 0, -100)

    def model(input_ids, attention_mask, use_cache):
        return types.SimpleNamespace(logits=two_class_logits(values))

    return batch, model


def trl_method_host(cls, **attrs):
    """A stand-in ``self`` for ``cls``'s loss methods: their attributes and the methods they call, bound."""
    host = types.SimpleNamespace(accelerator=_ACCELERATOR, aux_loss_enabled=False, is_encoder_decoder=False, **attrs)
    host.concatenated_inputs = cls.concatenated_inputs
    host.get_batch_logps = cls.get_batch_logps
    for name in ("concatenated_forward", "get_batch_loss_metrics", "cpo_loss", "odds_ratio_loss"):
        if hasattr(cls, name):
            setattr(host, name, types.MethodType(getattr(cls, name), host))
    return host


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("cpo_alpha", [0.0, 0.5])
def test_simpo_equals_trl_cpo_trainer(smoothing, cpo_alpha):
    """CPOTrainer ``loss_type="simpo"``: ``simpo_gamma = gamma_beta_ratio · beta``; CPO-SimPO's NLL
    (``cpo_alpha``) is an SFT component on the chosen completions (a token mean over the batch)."""
    beta, ratio = 2.0, 0.3
    seqs = make_seqs(6, seed=7)
    nll = {"nll": lambda t: Component(SFT(), t.mask & t.chosen, torch.full(t.mask.shape, cpo_alpha, dtype=F64))}
    objective = SimPO(beta=beta, gamma_beta_ratio=ratio, label_smoothing=smoothing)
    packed = pack(seqs, 3, preference(objective, **(nll if cpo_alpha else {})), seed=8)
    loss, metrics = packed.step()
    trn, _, prompts = rows(packed, seqs)
    batch, model = trl_pair_batch(trn, prompts)
    host = trl_method_host(CPOTrainer, loss_type="simpo", beta=beta, simpo_gamma=ratio * beta,
                           label_smoothing=smoothing, alpha=0.0, cpo_alpha=cpo_alpha, pad_token_id=0)  # fmt: skip
    expected, trl_metrics = host.get_batch_loss_metrics(model, batch)
    assert_same_step(loss, expected, packed.leaves, rtol=1e-9)
    assert_metrics(metrics, trl_metrics, TRL_METRICS, rel=1e-9)
    if cpo_alpha:
        assert metrics["nll/loss"].item() == pytest.approx(trl_metrics["nll_loss"], rel=1e-9)


def test_orpo_with_its_nll_as_an_sft_component_equals_trl_orpo_trainer():
    """ORPOTrainer's loss ``NLL − mean β log σ(log OR)``: the NLL over the chosen rows' prompt and
    completion (every token but the first) is an SFT component with ``normalize="token"``. TRL casts
    the mean log-probs to float32 in ``odds_ratio_loss``, hence the tolerance."""
    beta = 0.25
    seqs = make_seqs(6, seed=9)
    nll = {"nll": lambda t: Component(SFT(), mask=t.scored & t.chosen)}
    packed = pack(seqs, 2, preference(ORPO(beta=beta), **nll), seed=10)
    loss, metrics = packed.step()
    trn, _, prompts = rows(packed, seqs)
    batch, model = trl_pair_batch(trn, prompts)
    host = trl_method_host(ORPOTrainer, beta=beta, padding_value=0)
    expected, trl_metrics = host.get_batch_loss_metrics(model, batch)
    assert_same_step(loss, expected, packed.leaves, rtol=1e-5)
    assert_metrics(metrics, trl_metrics, (*TRL_METRICS, "log_odds_ratio", "log_odds_chosen"), rel=1e-5)
    assert metrics["nll/loss"].item() == pytest.approx(trl_metrics["nll_loss"], rel=1e-9)


# ---------------------------------------------------------------------------------------------------
# Per-pair paper formulas over hypothesis packings
# ---------------------------------------------------------------------------------------------------


def paper_pair_loss(objective, trn_c, trn_r, ref_c, ref_r) -> Tensor:
    """One pair's loss from its papers (DPO eq. 7, cDPO eq. 3, robust DPO, SLiC hinge, IPO eq. 17, SimPO
    eq. 6, ORPO eq. 6–7) on the members' log-probs of its chosen and rejected sequences."""

    def mean(x):
        return x.sum() / max(x.numel(), 1)

    if isinstance(objective, DPO):
        agg = mean if objective.length_normalized else torch.sum
        h = (agg(trn_c) - agg(ref_c)) - (agg(trn_r) - agg(ref_r))
        b, e = objective.beta, objective.label_smoothing
        return {
            "sigmoid": lambda: -(1 - e) * F.logsigmoid(b * h) - e * F.logsigmoid(-b * h),
            "robust": lambda: ((1 - e) * -F.logsigmoid(b * h) - e * -F.logsigmoid(-b * h)) / (1 - 2 * e),
            "hinge": lambda: torch.clamp(1 - b * h, min=0),
            "ipo": lambda: (h - 1 / (2 * b)) ** 2,
        }[objective.loss_type]()
    if isinstance(objective, SimPO):
        b, e = objective.beta, objective.label_smoothing
        u = b * mean(trn_c) - b * mean(trn_r) - objective.gamma_beta_ratio * b
        return -(1 - e) * F.logsigmoid(u) - e * F.logsigmoid(-u)
    odds_c = mean(trn_c) - torch.log(1 - torch.exp(mean(trn_c)))
    odds_r = mean(trn_r) - torch.log(1 - torch.exp(mean(trn_r)))
    return -objective.beta * F.logsigmoid(odds_c - odds_r)


PAPER_OBJECTIVES = [
    DPO(beta=0.3),
    DPO(beta=0.3, label_smoothing=0.25),
    DPO(beta=0.7, loss_type="robust", label_smoothing=0.2),
    DPO(beta=0.2, loss_type="hinge"),
    DPO(beta=0.4, loss_type="ipo"),
    DPO(beta=0.4, loss_type="ipo", average_log_prob=False),
    SimPO(beta=1.5, gamma_beta_ratio=0.4, label_smoothing=0.1),
    ORPO(beta=0.3),
]


@st.composite
def pair_packings(draw):
    """``(objective, seqs, empty pairs, bins, seed)``: pairs with prompts and completions, some pairs
    without any member (all their tokens masked), spread over 1–3 bins."""
    objective = draw(st.sampled_from(PAPER_OBJECTIVES))
    num_pairs = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    empty = draw(st.lists(st.booleans(), min_size=num_pairs, max_size=num_pairs))
    bins = draw(st.integers(1, min(3, num_pairs)))
    return objective, make_seqs(num_pairs, seed), empty, bins, seed


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=pair_packings())
def test_objectives_equal_the_per_pair_paper_formulas(case):
    objective, seqs, empty, bins, seed = case

    dropped = [Seq(s.pair, s.chosen, s.length if empty[s.pair] else s.prompt, s.trn, s.ref) for s in seqs]
    packed = pack(dropped, bins, preference(objective), seed)
    loss, metrics = packed.step()
    terms = []
    for p in range(len(empty)):
        if empty[p]:
            continue
        c, r = (next(s for s in dropped if s.pair == p and s.chosen is k) for k in (True, False))
        terms.append(paper_pair_loss(objective, packed.values(p, True)[c.prompt:], packed.values(p, False)[r.prompt:],
                                     c.ref[c.prompt:], r.ref[r.prompt:]))  # fmt: skip
    nothing = torch.where(torch.zeros_like(packed.leaves[0], dtype=torch.bool), packed.leaves[0], 0.0).sum()
    expected = torch.stack(terms).mean() if terms else nothing
    assert_same_step(loss, expected, packed.leaves, rtol=1e-9)
    assert metrics["pref/loss"].item() == pytest.approx(expected.item(), rel=1e-9, abs=1e-12)


def test_pair_weights_weight_the_pairs():
    """A weight constant over a pair's tokens weights its loss in the mean over pairs; a pair weighted 0
    has no member and is no pair."""
    seqs = make_seqs(4, seed=11)
    w = torch.tensor([0.5, 2.0, 0.0, 1.0], dtype=F64)
    objective = DPO(beta=0.2)
    packed = pack(seqs, 1, lambda t: {"pref": Component(objective, t.mask, w[t.pair], "group_mean")}, seed=12)
    loss, metrics = packed.step()
    per_pair = {}
    for p in (0, 1, 3):
        c, r = (next(s for s in seqs if s.pair == p and s.chosen is k) for k in (True, False))
        per_pair[p] = paper_pair_loss(objective, packed.values(p, True)[c.prompt:], packed.values(p, False)[r.prompt:],
                                      c.ref[c.prompt:], r.ref[r.prompt:])  # fmt: skip
    assert_same_step(loss, sum(w[p] * per_pair[p] for p in per_pair) / 3, packed.leaves)
    assert metrics["pref/loss"].item() == pytest.approx(sum(v.item() for v in per_pair.values()) / 3)


def test_an_empty_side_counts_as_trl_counts_it():
    """A pair whose rejected completion has no member token: its sum is 0 (TRL sums over an empty
    completion mask), and the pair still counts, as in TRL's mean."""
    seqs = make_seqs(4, seed=13)
    empty = next(s for s in seqs if s.pair == 2 and not s.chosen)
    empty.prompt = empty.length
    objective = DPO(beta=0.2)
    packed = pack(seqs, 2, preference(objective), seed=14)
    loss, metrics = packed.step()
    trn, ref, prompts = rows(packed, seqs)
    expected, trl_metrics = trl_dpo(trn, ref, prompts, loss_types=["sigmoid"], beta=0.2)
    assert_same_step(loss, expected, packed.leaves)
    assert_metrics(metrics, trl_metrics, TRL_METRICS, rel=1e-10)


# ---------------------------------------------------------------------------------------------------
# open-instruct #1900: a padded concat makes padding a spurious rejected sequence
# ---------------------------------------------------------------------------------------------------


@needs_openrlhf
@pytest.mark.parametrize("padding", ["non_member_tokens", "member_less_pair"])
def test_padding_never_becomes_a_spurious_sequence(padding):
    """Two pairs of 50-token completions at initialisation (policy = reference, so every pair's DPO loss
    is ln 2). open-instruct's olmo-core collator padded the chosen half to 500 tokens before appending
    the rejected half, and offset the rejected boundaries by 500: ``cu_seqlens = [0, 50, 100, 550,
    600]``, so the first "rejected sequence" spans the 400 padding tokens too. The padding scores 0
    under the policy (its labels are masked) and -0.19 per token in the reference's log-probs (a pass
    that scored it): OpenRLHF's own
    ``DPOLoss`` on the sums of that segmentation gives ≈ 6 ln 2. packloss, holding the same 600-token
    row with the padding as non-member tokens of a sequence or as a pair without members, gives the
    per-pair reference: ln 2, over 2 pairs."""
    g = torch.Generator().manual_seed(15)
    real = {key: (torch.rand(50, generator=g, dtype=F64) * 0.9 + 0.05).log() for key in ("c0", "c1", "r0", "r1")}
    pad_trn, pad_ref = torch.zeros(400, dtype=F64), torch.full((400,), -0.19, dtype=F64)
    trn = torch.cat([real["c0"], real["c1"], pad_trn, real["r0"], real["r1"]]).requires_grad_()
    ref = torch.cat([real["c0"], real["c1"], pad_ref, real["r0"], real["r1"]])  # policy = reference on real tokens
    beta = 0.1
    loss_fn = ORL.DPOLoss(beta=beta)

    buggy_lens = [50, 50, 450, 50]  # cu_seqlens [0, 50, 100, 550, 600]
    seq_ids = torch.repeat_interleave(torch.arange(4), torch.tensor(buggy_lens))
    pi = torch.zeros(4, dtype=F64).index_add(0, seq_ids, trn)
    rf = torch.zeros(4, dtype=F64).index_add(0, seq_ids, ref)
    buggy, _, _ = loss_fn(pi[:2], pi[2:], rf[:2], rf[2:])
    assert buggy.item() == pytest.approx(6 * math.log(2), rel=0.01)

    member = torch.ones(600, dtype=torch.bool)
    member[100:500] = False
    if padding == "non_member_tokens":  # the padding closes the second chosen sequence
        lens, group_ids, chosen = [50, 450, 50, 50], [0, 1, 0, 1], [True, True, False, False]
    else:  # the padding is a pair of its own, without members
        lens, group_ids = [50, 50, 200, 200, 50, 50], [0, 1, 2, 2, 0, 1]
        chosen = [True, True, True, False, False, False]
    plan = Plan(lens, {"dpo": Component(DPO(beta=beta), member, normalize="group_mean")}, ref_logprobs=ref,
                group_ids=group_ids, chosen=chosen)  # fmt: skip
    result = compute_loss(plan, Outputs(logprobs=trn), count_denominators([plan]))
    sums = {k: v.sum() for k, v in real.items()}
    expected, _, _ = loss_fn(
        torch.stack([trn[:50].sum(), trn[50:100].sum()]), torch.stack([trn[500:550].sum(), trn[550:].sum()]),
        torch.stack([sums["c0"], sums["c1"]]), torch.stack([sums["r0"], sums["r1"]]),
    )  # fmt: skip
    assert result.loss.item() == pytest.approx(math.log(2), rel=1e-12)
    assert_same_step(result.loss, expected, [trn])
    assert result.counts["dpo/loss"].item() == 2  # pairs, not 3
    assert count_denominators([plan]).denominator("dpo").item() == 2


# ---------------------------------------------------------------------------------------------------
# Plan checks and parameters
# ---------------------------------------------------------------------------------------------------


def _plan(objective, normalize="group_mean", *, group_ids=(0, 0, 1, 1), chosen=(True, False, False, True), ref=True):
    lens = [2, 3, 1, 2]
    mask = torch.ones(sum(lens), dtype=torch.bool)
    return Plan(
        lens,
        {"pref": Component(objective, mask=mask, normalize=normalize)},
        ref_logprobs=torch.full((8,), -1.0) if ref else None,
        group_ids=None if group_ids is None else list(group_ids),
        chosen=None if chosen is None else list(chosen),
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(group_ids=None, normalize="sequence_mean"), r"component 'pref' \(DPO\) needs the plan's group_ids"),
        (dict(chosen=None), r"component 'pref' \(DPO\) needs the plan's chosen flags"),
        (dict(ref=False), r"component 'pref' needs the plan's ref_logprobs"),
        (dict(group_ids=(0, 0, 0, 1)), r"component 'pref': group 0 holds 3 sequence\(s\) \[0, 1, 2\]"),
        (dict(group_ids=(0, 0, 1, 2)), r"component 'pref': group 1 holds 1 sequence\(s\) \[2\] in this bin"),
        (dict(chosen=(True, True, False, True)), r"component 'pref': group 0 holds two chosen sequences \(0 and 1\)"),
        (dict(chosen=(True, False, False, False)), r"group 1 holds two rejected sequences \(2 and 3\)"),
        (dict(normalize="token"), r"DPO's loss per pair is given to each of its member tokens, so normalize='token'"),
        (dict(normalize="sequence_sum"), r"use normalize='group_mean' or 'sequence_mean'"),
        (dict(normalize="position"), r"normalize='position'"),
    ],
)
def test_plan_checks_name_the_component(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _plan(DPO(), **kwargs)


def test_constant_mode_is_refused_and_reference_free_losses_need_no_reference():
    with pytest.raises(ValueError, match=r"normalize='constant'"):
        Plan([1, 1], {"pref": Component(SimPO(), torch.ones(2, dtype=torch.bool), None, "constant", 2.0)},
             group_ids=[0, 0], chosen=[True, False])  # fmt: skip
    for objective in (SimPO(), ORPO()):
        _plan(objective, ref=False)
    with pytest.raises(ValueError, match=r"\(ORPO\) needs the plan's group_ids"):
        _plan(ORPO(), "sequence_mean", group_ids=None)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: DPO(beta=0.0), ValueError, r"DPO.beta must be > 0"),
        (lambda: DPO(loss_type="kto"), ValueError, r"DPO.loss_type must be one of"),
        (lambda: DPO(loss_type="ipo", label_smoothing=0.1), ValueError, r"applies to 'sigmoid' and 'robust'"),
        (lambda: DPO(loss_type="robust", label_smoothing=0.5), ValueError, r"\[0, 0.5\) for 'robust'"),
        (lambda: DPO(label_smoothing=0.6), ValueError, r"\[0, 0.5\] for 'sigmoid'"),
        (lambda: DPO(average_log_prob=1), TypeError, r"DPO.average_log_prob must be a bool"),
        (lambda: SimPO(beta=-1.0), ValueError, r"SimPO.beta must be > 0"),
        (lambda: SimPO(gamma_beta_ratio="0.5"), TypeError, r"SimPO.gamma_beta_ratio must be a number"),
        (lambda: SimPO(label_smoothing=0.7), ValueError, r"SimPO.label_smoothing must be in \[0, 0.5\]"),
        (lambda: ORPO(beta=float("nan")), ValueError, r"ORPO.beta must be finite"),
    ],
)
def test_bad_parameters_name_the_argument(make, error, message):
    with pytest.raises(error, match=message):
        make()


# ---------------------------------------------------------------------------------------------------
# Numerics, synchronisation, op counts
# ---------------------------------------------------------------------------------------------------

OBJECTIVES = [DPO(beta=0.3), DPO(beta=0.3, loss_type="ipo"), DPO(loss_type="robust", label_smoothing=0.1),
              SimPO(), ORPO()]  # fmt: skip


@pytest.mark.parametrize("objective", OBJECTIVES, ids=repr)
def test_non_members_may_hold_anything(objective):
    """inf / NaN in the trainer's and the reference's log-probs off the members change neither the
    loss, the gradient nor the metrics (every sequence's prompt is non-member)."""
    seqs = make_seqs(5, seed=16)
    clean = pack([Seq(s.pair, s.chosen, s.prompt, s.trn.nan_to_num(-1.0), s.ref.nan_to_num(-1.0)) for s in seqs],
                 2, preference(objective), seed=17)  # fmt: skip
    poisoned_seqs = []
    for i, s in enumerate(seqs):
        trn, ref = s.trn.clone(), s.ref.clone()
        trn[: s.prompt] = (float("inf"), float("-inf"), float("nan"))[i % 3]
        ref[: s.prompt] = (float("nan"), float("inf"), float("-inf"))[i % 3]
        poisoned_seqs.append(Seq(s.pair, s.chosen, s.prompt, trn, ref))
    poisoned = pack(poisoned_seqs, 2, preference(objective), seed=17)
    (loss_a, metrics_a), (loss_b, metrics_b) = clean.step(), poisoned.step()
    assert torch.isfinite(loss_b) and torch.equal(loss_a, loss_b)
    for a, b in zip(grads(loss_a, clean.leaves), grads(loss_b, poisoned.leaves), strict=True):
        assert torch.equal(a, b)
    assert metrics_a.keys() == metrics_b.keys() and all(torch.equal(metrics_a[k], metrics_b[k]) for k in metrics_a)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("objective", OBJECTIVES, ids=repr)
def test_low_precision_inputs_are_computed_in_float32(objective, dtype):
    seqs = make_seqs(4, seed=18)
    low = pack(seqs, 1, preference(objective), seed=19, dtype=dtype)
    high = pack([Seq(s.pair, s.chosen, s.prompt, s.trn.to(dtype).to(F64), s.ref.to(dtype).to(F64)) for s in seqs],
                1, preference(objective), seed=19)  # fmt: skip
    loss, metrics = low.step()
    assert loss.dtype == torch.float32 and all(v.dtype == torch.float32 for v in metrics.values())
    assert loss.item() == pytest.approx(high.step()[0].item(), rel=1e-5)
    (grad,) = torch.autograd.grad(loss, low.leaves)
    assert grad.dtype == dtype and torch.isfinite(grad.float()).all()


def _bins_of(num_pairs: int, objective) -> tuple[Plan, Tensor]:
    packed = pack(make_seqs(num_pairs, seed=20), 1, preference(objective), seed=21)
    return packed.plans[0], packed.leaves[0]


@pytest.mark.parametrize("per_sequence_metrics", [False, True])
@pytest.mark.parametrize("objective", OBJECTIVES, ids=repr)
def test_no_sync_and_an_op_count_flat_in_the_pairs(objective, per_sequence_metrics):
    counted = []
    for num_pairs in (4, 64):
        plan, trn = _bins_of(num_pairs, objective)
        den = count_denominators([plan])
        with OpCounter() as ops:
            result = compute_loss(plan, Outputs(logprobs=trn), den, per_sequence_metrics=per_sequence_metrics)
            result.loss.backward()
        assert ops.num_syncs == 0, ops.syncs
        counted.append(ops.ops)
    assert counted[0] == counted[1]


def test_per_sequence_metrics_give_each_sequence_its_pair():
    plan, trn = _bins_of(3, DPO(beta=0.2))
    whole = compute_loss(plan, Outputs(logprobs=trn))
    per_seq = compute_loss(plan, Outputs(logprobs=trn), per_sequence_metrics=True)
    for name in ("pref/loss", "pref/rewards/chosen", "pref/logps/rejected", "pref/rewards/accuracies"):
        values, counts = per_seq.metrics[name], per_seq.counts[name]
        assert values.shape == (6,) and torch.equal(counts, torch.ones(6))
        pair_of = torch.tensor(plan.group_ids)
        for g in range(3):  # both sequences of a pair report the pair's value
            assert torch.unique(values[pair_of == g]).numel() == 1
        assert values.mean().item() == pytest.approx(whole.metrics[name].item(), rel=1e-12)


# ---------------------------------------------------------------------------------------------------
# A context-parallel bin, and the snippet of docs/preference.md
# ---------------------------------------------------------------------------------------------------

_CP_PROGRAM = """
import torch
from packloss import SFT, Component, ContextShard, Outputs, Plan, all_reduce_metrics, compute_loss, count_denominators
from packloss.core.kto import KTO, kto_reference_kl
from packloss.core.preference import DPO, SimPO


def step(rank, world):
    g = torch.Generator().manual_seed(0)

    def draw(lens):
        n = sum(lens)
        ref = (torch.rand(n, generator=g, dtype=torch.float64) * 0.9 + 0.05).log()
        trn = ref + 0.2 + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
        mask = torch.rand(n, generator=g) < 0.8
        shard = ContextShard.contiguous(lens, rank, world) if world > 1 else None
        pos = shard.positions if shard is not None else torch.arange(n)
        return trn[pos].clone().requires_grad_(), ref[pos], mask[pos], shard, pos, n

    kl_lens = [5, 2, 8, 3]
    kl_trn, kl_ref, kl_mask, kl_shard, _, _ = draw(kl_lens)
    kl_plan = Plan(kl_lens, {"kl": Component(SFT(), kl_mask)}, ref_logprobs=kl_ref, shard=kl_shard)
    z = kto_reference_kl([kl_plan], [kl_trn], "kl", all_reduce=world > 1)
    lens = [7, 3, 9, 2, 5, 4]
    trn, ref, mask, shard, pos, n = draw(lens)
    comps = {
        "dpo": Component(DPO(beta=0.3), mask, normalize="group_mean"),
        "simpo": Component(SimPO(), mask, normalize="sequence_mean"),
        "kto": Component(KTO(beta=0.5, desirable_weight=1.2, kl=z), mask, normalize="sequence_mean"),
    }
    group_ids, chosen = [2, 0, 1, 0, 2, 1], [True, True, False, False, False, True]
    plan = Plan(lens, comps, ref_logprobs=ref, group_ids=group_ids, chosen=chosen, shard=shard)
    result = compute_loss(plan, Outputs(logprobs=trn), count_denominators([plan], all_reduce=world > 1, num_groups=3))
    result.loss.backward()
    total, metrics, counts = result.loss.detach().clone(), result.metrics, result.counts
    if world > 1:
        torch.distributed.all_reduce(total)
        metrics, counts = all_reduce_metrics(metrics, counts)
    return z, total, torch.zeros(n, dtype=torch.float64).index_copy(0, pos, trn.grad), metrics, counts
"""


def test_a_context_parallel_bin_equals_one_process():
    """DPO, SimPO and KTO (with :func:`~packloss.core.kto.kto_reference_kl` over a sharded KL bin, all-reduced)
    on two contiguous shards, sequences cut across the ranks: the KL estimate is the one process's, the
    ranks' losses sum (all-reduced) to its loss, their gradients to its gradient, their all-reduced metrics
    and counts equal its own."""
    namespace: dict = {}
    exec(compile(_CP_PROGRAM, "cp_program", "exec"), namespace)
    z, loss, grad, metrics, counts = namespace["step"](0, 1)
    ranks = run_gloo(run_program, world_size=2, args=(_CP_PROGRAM, "step"))
    assert z > 0
    torch.testing.assert_close(sum(r[2] for r in ranks), grad, rtol=1e-12, atol=1e-14)
    for rank_z, total, _, m, c in ranks:
        torch.testing.assert_close(rank_z, z, rtol=1e-12, atol=0)
        torch.testing.assert_close(total, loss.detach(), rtol=1e-12, atol=1e-14)
        assert m.keys() == metrics.keys()
        for k in metrics:
            torch.testing.assert_close(m[k].to(F64), metrics[k].to(F64), rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(c[k], counts[k].to(c[k].dtype))


def test_the_docs_snippet_runs():
    text = (ROOT / "docs" / "preference.md").read_text()
    program = "\n".join(re.findall(r"```python\n(.*?)```", text, flags=re.S))
    namespace: dict = {}
    exec(compile(program, "docs/preference.md", "exec"), namespace)
    assert torch.isfinite(namespace["result"].loss)
