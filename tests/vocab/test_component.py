"""packloss.vocab.component: ``VocabDistill`` through the engine (``compute_loss``), from logits and from
hidden states, against hand-written formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from packloss.core.bin import Component, Plan
from packloss.core.engine import compute_loss
from packloss.core.outputs import Outputs
from packloss.vocab import VocabDistill, VocabParallel

SEQ_LENS = [4, 1, 6, 3]  # N = 14, the second sequence has no member
N, H, V, H_T = 14, 6, 19, 5
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}


def _bin(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    teacher_hidden = torch.randn(N, H_T, generator=g, dtype=torch.float64).to(dtype)
    teacher_weight = torch.randn(V, H_T, generator=g, dtype=torch.float64).to(dtype)
    mask = torch.tensor([0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 1, 0], dtype=torch.bool)
    return hidden, weight, teacher_hidden, teacher_weight, mask


def _naive_per_token(kind: str, s: torch.Tensor, t: torch.Tensor, beta: float, temperature: float) -> torch.Tensor:
    """``[N]`` divergences in float64 from materialised logits (the hand-written reference)."""
    log_q = F.log_softmax(s.double() / temperature, dim=-1)
    log_p = F.log_softmax(t.double(), dim=-1)
    q, p = log_q.exp(), log_p.exp()
    if kind == "reverse_kl":
        return (q * (log_q - log_p)).sum(-1)
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    return beta * (p * (log_p - log_m)).sum(-1) + (1 - beta) * (q * (log_q - log_m)).sum(-1)


def _formula(per_token: torch.Tensor, mask: torch.Tensor, normalize: str, weights=None) -> torch.Tensor:
    """The component's term, written out: token → Σ_members w L / #members; sequence_mean →
    Σ_sequences (Σ_{t∈s} m L / n_s) / #(sequences with a member)."""
    w = torch.ones(N, dtype=torch.float64) if weights is None else weights.double()
    if normalize == "token":
        return sum(w[i] * per_token[i] for i in range(N) if mask[i]) / int(mask.sum())
    total, seqs, start = 0.0, 0, 0
    for n in SEQ_LENS:
        members = [i for i in range(start, start + n) if mask[i]]
        if members:
            total = total + sum(w[i] * per_token[i] for i in members) / len(members)
            seqs += 1
        start += n
    return total / seqs


def _plan(component: VocabDistill, mask, normalize: str, weights=None, **teacher) -> Plan:
    return Plan(seq_lens=SEQ_LENS, components={"kd": Component(component, mask=mask, weights=weights,
                                                               normalize=normalize)}, **teacher)  # fmt: skip


def _outputs(path: str, hidden: torch.Tensor, weight: torch.Tensor) -> Outputs:
    return Outputs(logits=hidden @ weight.T) if path == "logits" else Outputs(hidden=hidden, head_weight=weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("normalize", ["token", "sequence_mean"])
@pytest.mark.parametrize("path", ["logits", "hidden"])
@pytest.mark.parametrize("kind", ["reverse_kl", "jsd"])
def test_engine_loss_matches_formula(dtype, normalize, path, kind) -> None:
    hidden, weight, teacher_hidden, teacher_weight, mask = _bin(dtype)
    teacher_logits = teacher_hidden @ teacher_weight.T  # [N, V]
    component = VocabDistill(kind=kind, beta=0.3, temperature=1.3, chunk_size=4)
    plan = _plan(component, mask, normalize, teacher_logits=teacher_logits)
    result = compute_loss(plan, _outputs(path, hidden, weight))
    per_token = _naive_per_token(kind, hidden.detach() @ weight.detach().T, teacher_logits, 0.3, 1.3)
    want = _formula(per_token, mask, normalize)
    assert result.loss.dtype == dtype
    torch.testing.assert_close(result.loss.double(), want, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(
        result.per_token["kd"].double(), torch.where(mask, per_token, 0.0), rtol=TOL[dtype], atol=TOL[dtype]
    )
    mean = per_token[mask].mean()
    torch.testing.assert_close(result.metrics[f"kd/{kind}"].double(), mean, rtol=TOL[dtype], atol=TOL[dtype])
    assert result.counts[f"kd/{kind}"] == mask.sum()


@pytest.mark.parametrize("normalize", ["token", "sequence_mean"])
@pytest.mark.parametrize("teacher", ["logits", "head"])
def test_logits_and_hidden_paths_agree(normalize, teacher) -> None:
    """Same loss, per-token losses and gradients w.r.t. hidden and weight; with component weights, and a
    teacher given as logits or as a head (hidden path only)."""
    hidden, weight, teacher_hidden, teacher_weight, mask = _bin(torch.float64, seed=1)
    weights = torch.rand(N, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.5
    teacher_logits = teacher_hidden @ teacher_weight.T
    component = VocabDistill(kind="forward_kl", teacher_temperature=0.8, chunk_size=5)
    results, grads = [], []
    for path in ("logits", "hidden"):
        source = {"teacher_logits": teacher_logits}
        if path == "hidden" and teacher == "head":
            source = {"teacher_hidden": teacher_hidden, "teacher_weight": teacher_weight}
        result = compute_loss(_plan(component, mask, normalize, weights, **source), _outputs(path, hidden, weight))
        results.append(result)
        grads.append(torch.autograd.grad(result.loss, [hidden, weight]))
    logits_path, hidden_path = results
    torch.testing.assert_close(hidden_path.loss, logits_path.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hidden_path.per_token["kd"], logits_path.per_token["kd"], rtol=1e-12, atol=1e-12)
    for a, b in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    per_token = F.kl_div(  # forward KL written with torch's own kl_div
        F.log_softmax(hidden.detach() @ weight.detach().T, -1), F.log_softmax(teacher_logits / 0.8, -1),
        reduction="none", log_target=True,
    ).sum(-1)  # fmt: skip
    want = _formula(per_token, mask, normalize, weights)
    torch.testing.assert_close(hidden_path.loss, want, rtol=1e-12, atol=1e-12)


def _leaves_and_outputs(path: str, hidden: torch.Tensor, weight: torch.Tensor, mask, garbage: float | None):
    """The differentiable leaves and the outputs of a path; ``garbage`` written to the non-member rows of
    the student's logits (logits path) or hidden states (hidden path)."""
    if path == "logits":
        logits = (hidden @ weight.T).detach()  # [N, V]
        if garbage is not None:
            logits[~mask] = garbage
        logits.requires_grad_()
        return [logits], Outputs(logits=logits)
    h = hidden.detach().clone()
    if garbage is not None:
        h[~mask] = garbage
    h.requires_grad_()
    return [h, weight], Outputs(hidden=h, head_weight=weight)


@pytest.mark.parametrize("path", ["logits", "hidden"])
@pytest.mark.parametrize("garbage", [math.nan, math.inf])
def test_non_member_rows_may_hold_anything(path, garbage) -> None:
    hidden, weight, teacher_hidden, teacher_weight, mask = _bin(torch.float32, seed=2)
    teacher_logits = teacher_hidden @ teacher_weight.T
    dirty_t = teacher_logits.clone()
    dirty_t[~mask] = -garbage
    component = VocabDistill(chunk_size=3)
    leaves, outputs = _leaves_and_outputs(path, hidden, weight, mask, None)
    clean = compute_loss(_plan(component, mask, "token", teacher_logits=teacher_logits), outputs)
    clean_grads = torch.autograd.grad(clean.loss, leaves)
    leaves, outputs = _leaves_and_outputs(path, hidden, weight, mask, garbage)
    dirty = compute_loss(_plan(component, mask, "token", teacher_logits=dirty_t), outputs)
    dirty_grads = torch.autograd.grad(dirty.loss, leaves)
    torch.testing.assert_close(dirty.loss, clean.loss, rtol=0, atol=0)
    for a, b in zip(dirty_grads, clean_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_plan_without_a_teacher_names_the_component() -> None:
    *_, mask = _bin(torch.float32)
    with pytest.raises(ValueError, match="'kd'.*teacher_logits"):
        _plan(VocabDistill(), mask, "token")


def test_missing_outputs_name_the_component_and_both_options() -> None:
    hidden, weight, teacher_hidden, teacher_weight, mask = _bin(torch.float32)
    plan = _plan(VocabDistill(), mask, "token", teacher_logits=teacher_hidden @ teacher_weight.T)
    with pytest.raises(ValueError, match="'kd'.*outputs.logits.*outputs.hidden"):
        compute_loss(plan, Outputs(logprobs=torch.zeros(N, requires_grad=True)))
    head_plan = _plan(VocabDistill(), mask, "token", teacher_hidden=teacher_hidden, teacher_weight=teacher_weight)
    with pytest.raises(ValueError, match="'kd'.*teacher_hidden needs outputs.hidden"):
        compute_loss(head_plan, Outputs(logits=hidden @ weight.T))


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(kind="kl"), ValueError, "kind"),
        (dict(beta=1.5), ValueError, "beta"),
        (dict(beta=math.nan), ValueError, "beta"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=math.nan), ValueError, "temperature"),
        (dict(teacher_temperature=math.inf), ValueError, "teacher_temperature"),
        (dict(temperature="2"), TypeError, "temperature"),
        (dict(teacher_format="softmax"), ValueError, "teacher_format"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(impl="triton"), ValueError, "impl"),
        (dict(parallel="world"), TypeError, "parallel"),
    ],
)
def test_vocab_distill_validation(kwargs, error, name) -> None:
    with pytest.raises(error, match=name):
        VocabDistill(**kwargs)


def test_vocab_distill_is_a_frozen_value() -> None:
    component = VocabDistill(kind="jsd", beta=1, temperature=2, parallel=VocabParallel(object()))
    assert (component.beta, component.temperature) == (1.0, 2.0)
    assert component == VocabDistill(kind="jsd", beta=1.0, temperature=2.0, parallel=component.parallel)
    with pytest.raises(AttributeError):
        component.kind = "reverse_kl"


def test_hidden_path_through_the_engine_allocates_no_extra_gradient_buffer() -> None:
    """The engine anchors outputs only when no term is attached: the fused path's backward makes no
    ``[N, H]`` / ``[V, H]`` zeros for an empty-slice anchor."""
    from packloss.testing import OpCounter

    g = torch.Generator().manual_seed(3)
    n, h, v = 10, 8, 16
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    mask = torch.rand(n, generator=g) < 0.7
    plan = Plan([4, 6], {"kd": Component(VocabDistill(), mask=mask)}, teacher_logits=torch.randn(n, v, generator=g))
    result = compute_loss(plan, Outputs(hidden=hidden, head_weight=weight))
    with OpCounter() as counter:
        result.loss.backward()
    assert counter.ops["aten.slice_backward"] == 0 and counter.ops["aten.add"] == 0, counter.ops
    assert hidden.grad is not None and weight.grad is not None


GROUP_IDS = [0, 1, 0, 1]  # prompt group of each sequence in SEQ_LENS
MODES = ["token", "position", "sequence_mean", "sequence_sum", "constant", "group_mean"]


def _formula_any_mode(per_token, mask, mode, weights, seq_lens=SEQ_LENS, groups=GROUP_IDS, constant=7.0):
    """Every mode's term written out in plain Python (float64)."""
    offsets = [sum(seq_lens[:i]) for i in range(len(seq_lens))]
    sums, members = [], []
    for start, n in zip(offsets, seq_lens, strict=True):
        idx = [i for i in range(start, start + n) if mask[i]]
        sums.append(sum((weights[i] * per_token[i] for i in idx), torch.zeros((), dtype=torch.float64)))
        members.append(len(idx))
    total = sum(sums)
    live = [i for i, k in enumerate(members) if k]
    if mode == "token":
        return total / sum(members)
    if mode == "position":
        return total / sum(seq_lens)
    if mode == "constant":
        return total / constant
    if mode == "sequence_sum":
        return total / len(live)
    if mode == "sequence_mean":
        return sum(sums[i] / members[i] for i in live) / len(live)
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        by_group.setdefault(g, []).append(i)
    terms = [sum(sums[i] for i in seqs) / sum(members[i] for i in seqs) for seqs in by_group.values()
             if sum(members[i] for i in seqs)]  # fmt: skip
    return sum(terms) / len(terms)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", ["logits", "hidden"])
def test_every_mode_equals_its_hand_formula(path, mode) -> None:
    hidden, weight, _, _, mask = _bin(torch.float64)
    g = torch.Generator().manual_seed(5)
    teacher = torch.randn(N, V, generator=g, dtype=torch.float64)
    w = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    comp = Component(VocabDistill("reverse_kl"), mask=mask, weights=w, normalize=mode,
                     constant=7.0 if mode == "constant" else None)  # fmt: skip
    plan = Plan(SEQ_LENS, {"kd": comp}, teacher_logits=teacher, group_ids=GROUP_IDS)
    got = compute_loss(plan, _outputs(path, hidden, weight)).loss
    expected = _formula_any_mode(_naive_per_token("reverse_kl", hidden @ weight.T, teacher, 0.5, 1.0), mask, mode, w)
    assert torch.allclose(got, expected, rtol=1e-12, atol=0), (float(got), float(expected))


def _step_grads(path: str, mode: str, order: list[int], num_bins: int):
    """The step's gradient w.r.t. hidden and weight with the sequences dealt into ``num_bins`` plans."""
    from packloss import count_denominators

    hidden, weight, _, _, mask = _bin(torch.float64, seed=1)
    g = torch.Generator().manual_seed(6)
    teacher = torch.randn(N, V, generator=g, dtype=torch.float64)
    w = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    starts = [sum(SEQ_LENS[:i]) for i in range(len(SEQ_LENS))]
    parts = []
    for chunk in (order[i::num_bins] for i in range(num_bins)):
        index = torch.cat([torch.arange(starts[q], starts[q] + SEQ_LENS[q]) for q in chunk])
        comp = Component(VocabDistill("jsd", beta=0.3), mask=mask[index], weights=w[index], normalize=mode,
                         constant=7.0 if mode == "constant" else None)  # fmt: skip
        plan = Plan([SEQ_LENS[q] for q in chunk], {"kd": comp}, teacher_logits=teacher[index],
                    group_ids=[GROUP_IDS[q] for q in chunk])  # fmt: skip
        parts.append((plan, _outputs(path, hidden[index], weight)))
    den = count_denominators([p for p, _ in parts], num_groups=2)
    total = sum(compute_loss(p, o, den).loss for p, o in parts)
    return torch.autograd.grad(total, [hidden, weight])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", ["logits", "hidden"])
def test_step_gradient_invariant_to_packing_and_order(path, mode) -> None:
    whole = _step_grads(path, mode, [0, 1, 2, 3], 1)
    assert all(g.abs().sum() > 0 for g in whole)
    for order, num_bins in (([3, 1, 0, 2], 2), ([2, 0, 3, 1], 4)):
        for got, ref in zip(_step_grads(path, mode, order, num_bins), whole, strict=True):
            assert torch.allclose(got, ref, rtol=1e-12, atol=1e-15), (order, num_bins)
