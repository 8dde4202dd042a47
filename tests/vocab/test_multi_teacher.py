"""packloss.vocab.multi_teacher: ``MultiTeacherDistill`` through the engine against a float64 reference
that builds each token's teacher logits densely (``h'_t · W_{k(t)}ᵀ``, one token at a time) and a
brute-force divergence written here; ``T = 1`` is ``VocabDistill`` bit for bit; no syncs, op counts flat
in the number of sequences, nothing of ``N × V`` in the fused pass, non-member rows inert."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from packloss.core.bin import Component, Plan
from packloss.core.engine import compute_loss
from packloss.core.outputs import Outputs
from packloss.core.step import count_denominators
from packloss.testing import OpCounter
from packloss.vocab import VocabDistill
from packloss.vocab.multi_teacher import MultiTeacherDistill, TeacherHeads, linear_multi_distill

from .harness import MaxNumel

KINDS = ["reverse_kl", "forward_kl", "soft_cross_entropy", "jsd"]
H, H_T = 4, 3


def _brute(kind: str, s: torch.Tensor, u: torch.Tensor, beta: float, temperature: float, t_temp: float):
    """``[N]`` float64 divergences between ``softmax(s / T)`` and ``softmax(u / T_t)``, row by row."""
    log_q, log_p = torch.log_softmax(s / temperature, dim=-1), torch.log_softmax(u / t_temp, dim=-1)
    q, p = log_q.exp(), log_p.exp()
    forward = (torch.xlogy(p, p) - p * log_q).sum(-1)
    reverse = (q * (log_q - log_p)).sum(-1)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
        return reverse
    if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
        return forward
    if kind == "soft_cross_entropy":
        return -(p * log_q).sum(-1)
    log_m = torch.log(beta * p + (1 - beta) * q)
    return beta * (torch.xlogy(p, p) - p * log_m).sum(-1) + (1 - beta) * (q * (log_q - log_m)).sum(-1)


def _teacher_logits(t_hidden: torch.Tensor, heads: list[torch.Tensor], token_teacher: list[int]) -> torch.Tensor:
    """``[N, V]``: token ``i``'s own teacher's logits, one token at a time."""
    return torch.stack([t_hidden[i].double() @ heads[k].double().T for i, k in enumerate(token_teacher)])


def _term(per_token, members, weights, seq_lens, normalize):
    """The component's term written out: token, sequence_mean or sequence_sum."""
    contrib = [weights[i] * per_token[i] if members[i] else 0.0 for i in range(len(members))]
    total, seqs, start = 0.0, 0, 0
    for n in seq_lens:
        idx = [i for i in range(start, start + n) if members[i]]
        if idx:
            seqs += 1
            part = sum(contrib[i] for i in idx)
            total = total + (part / len(idx) if normalize == "sequence_mean" else part)
        start += n
    if normalize == "token":
        return sum(contrib) / max(sum(members), 1)
    return total / max(seqs, 1)


def _tensors(seed: int, n: int, v: int, t: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(v, H, generator=g, dtype=torch.float64).to(dtype)
    t_hidden = torch.randn(n, H_T, generator=g, dtype=torch.float64).to(dtype)
    t_weights = (2 * torch.randn(t, v, H_T, generator=g, dtype=torch.float64)).to(dtype)
    return hidden, weight, t_hidden, t_weights, g


def _token_teacher(seq_lens, per_seq: list[int]) -> list[int]:
    """Every token's teacher from every sequence's."""
    return [k for k, n in zip(per_seq, seq_lens, strict=True) for _ in range(n)]


@st.composite
def _cases(draw):
    seq_lens = draw(st.lists(st.integers(1, 5), min_size=1, max_size=5))
    n, t = sum(seq_lens), draw(st.sampled_from([1, 2, 3]))
    per_token = draw(st.booleans())
    ids = draw(st.lists(st.integers(0, t - 1), min_size=n if per_token else len(seq_lens),
                        max_size=n if per_token else len(seq_lens)))  # fmt: skip
    if t > 1 and draw(st.booleans()):  # a teacher with no tokens
        gone = draw(st.integers(0, t - 1))
        ids = [(k + 1) % t if k == gone else k for k in ids]
    kind = draw(st.sampled_from(KINDS))
    return dict(
        seq_lens=seq_lens, t=t, per_token=per_token, ids=ids, kind=kind,
        beta=draw(st.sampled_from([0.0, 0.3, 1.0])) if kind == "jsd" else 0.5,
        temperature=draw(st.sampled_from([1.0, 0.7, 1.6])), t_temp=draw(st.sampled_from([1.0, 0.8, 1.5])),
        normalize=draw(st.sampled_from(["token", "sequence_mean", "sequence_sum"])),
        weighted=draw(st.booleans()), path=draw(st.sampled_from(["hidden", "hidden", "logits"])),
        chunk=draw(st.sampled_from([None, 1, 2, 3, 5])), as_list=draw(st.booleans()), v=draw(st.sampled_from([5, 11])),
        seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_cases())
def test_equals_a_dense_float64_reference(case) -> None:
    seq_lens, t, kind = case["seq_lens"], case["t"], case["kind"]
    n = sum(seq_lens)
    hidden, weight, t_hidden, t_weights, g = _tensors(case["seed"], n, case["v"], t)
    mask = torch.rand(n, generator=g) < 0.7
    weights = torch.rand(n, generator=g, dtype=torch.float64) + 0.5 if case["weighted"] else None
    t_hidden.requires_grad_()
    t_weights.requires_grad_()
    heads = list(t_weights.unbind(0)) if case["as_list"] else t_weights
    if case["per_token"]:
        teachers = TeacherHeads(t_hidden, heads, torch.tensor(case["ids"]))
    else:
        teachers = TeacherHeads(t_hidden, heads, case["ids"], seq_lens=seq_lens)
    objective = MultiTeacherDistill(
        kind,
        beta=case["beta"],
        temperature=case["temperature"],
        teacher_temperature=case["t_temp"],
        chunk_size=case["chunk"],
        teachers=teachers,
    )
    plan = Plan(seq_lens, {"kd": Component(objective, mask=mask, weights=weights, normalize=case["normalize"])})
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    z = (hidden @ weight.T).requires_grad_()
    outputs = Outputs(hidden=h, head_weight=w) if case["path"] == "hidden" else Outputs(logits=z)
    result = compute_loss(plan, outputs)
    leaves = [h, w] if case["path"] == "hidden" else [z]
    grads = torch.autograd.grad(result.loss, leaves + [t_hidden, t_weights], allow_unused=True)
    assert grads[-2:] == (None, None), "the teachers received a gradient"

    token_teacher = case["ids"] if case["per_token"] else _token_teacher(seq_lens, case["ids"])
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    z64 = (hidden @ weight.T).requires_grad_()
    s = h64 @ w64.T if case["path"] == "hidden" else z64
    u = _teacher_logits(t_hidden.detach(), list(t_weights.detach()), token_teacher)
    per_token = _brute(kind, s, u, case["beta"], case["temperature"], case["t_temp"])
    wts = torch.ones(n, dtype=torch.float64) if weights is None else weights
    members = [bool(mask[i]) and float(wts[i]) != 0 for i in range(n)]
    want = _term(per_token, members, wts, seq_lens, case["normalize"])
    want = want if isinstance(want, torch.Tensor) else torch.tensor(want, dtype=torch.float64)
    leaves64 = [h64, w64] if case["path"] == "hidden" else [z64]
    want_grads = torch.autograd.grad(want, leaves64, allow_unused=True) if want.requires_grad else [None] * len(leaves)
    torch.testing.assert_close(result.loss, want.detach(), rtol=1e-10, atol=1e-12)
    for got, exp, leaf in zip(grads[:-2], want_grads, leaves, strict=True):
        got, exp = (torch.zeros_like(leaf) if x is None else x for x in (got, exp))
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12)
    for k in [None, *range(t)]:
        rows = [i for i in range(n) if members[i] and (k is None or token_teacher[i] == k)]
        key = f"kd/{kind}" if k is None else f"kd/teacher{k}/{kind}"
        mean = sum(float(per_token[i].detach()) for i in rows) / max(len(rows), 1)
        assert math.isclose(float(result.metrics[key]), mean, rel_tol=1e-10, abs_tol=1e-12), key
        assert int(result.counts[key]) == len(rows), key


# ---------------------------------------------------------------------------------------------------
# One teacher is VocabDistill
# ---------------------------------------------------------------------------------------------------

SEQ_LENS = [4, 1, 6, 3, 5]  # N = 19


@pytest.mark.parametrize("path", ["hidden", "logits"])
@pytest.mark.parametrize("index", ["sequence", "token"])
@pytest.mark.parametrize("kind", KINDS)
def test_one_teacher_is_vocab_distill(index, kind, path) -> None:
    """Bit for bit through the fused head; to float32 rounding from logits (VocabDistill reads teacher logits
    made by one [N, H_t] x [H_t, V] matmul, MultiTeacherDistill makes them chunk by chunk)."""
    n, v = sum(SEQ_LENS), 23
    hidden, weight, t_hidden, t_weights, g = _tensors(3, n, v, 1, dtype=torch.float32)
    mask, weights = torch.rand(n, generator=g) < 0.8, torch.rand(n, generator=g) + 0.5
    ids = torch.zeros(n, dtype=torch.long) if index == "token" else [0] * len(SEQ_LENS)
    opts = dict(beta=0.3, temperature=1.3, teacher_temperature=0.9, chunk_size=4)
    multi = MultiTeacherDistill(kind, **opts, teachers=TeacherHeads(t_hidden, t_weights, ids,
                                seq_lens=None if index == "token" else SEQ_LENS))  # fmt: skip
    if path == "hidden":
        single = dict(teacher_hidden=t_hidden, teacher_weight=t_weights[0])
    else:
        single = dict(teacher_logits=t_hidden @ t_weights[0].T)
    results, metrics = [], {}
    for objective, teacher in ((multi, {}), (VocabDistill(kind, **opts), single)):
        component = Component(objective, mask=mask, weights=weights, normalize="sequence_mean")
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        z = (h @ w.T).detach().requires_grad_()
        outputs = Outputs(hidden=h, head_weight=w) if path == "hidden" else Outputs(logits=z)
        result = compute_loss(Plan(SEQ_LENS, {"kd": component}, **teacher), outputs)
        leaves = [h, w] if path == "hidden" else [z]
        results.append([result.loss, result.metrics[f"kd/{kind}"], *torch.autograd.grad(result.loss, leaves)])
        metrics = metrics or result.metrics  # the first run's: MultiTeacherDistill's
    for got, want in zip(*results, strict=True):
        if path == "hidden":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert torch.equal(metrics[f"kd/teacher0/{kind}"], metrics[f"kd/{kind}"])  # the only teacher's is the overall


# ---------------------------------------------------------------------------------------------------
# Syncs, op counts, matmul rows, allocations, non-member rows
# ---------------------------------------------------------------------------------------------------

# two packings of N = 24 tokens with 8 tokens per teacher, teachers interleaved (a permutation)
LAYOUTS = [([8, 8, 8], [2, 0, 1]), ([2] * 12, [0, 1, 2] * 4)]


def _step(seq_lens, ids, index: str, path: str, v: int = 40, seed: int = 5):
    n = sum(seq_lens)
    hidden, weight, t_hidden, t_weights, _ = _tensors(seed, n, v, 3, dtype=torch.float32)
    if index == "token":
        teachers = TeacherHeads(t_hidden, t_weights, torch.tensor(_token_teacher(seq_lens, ids)))
    else:
        teachers = TeacherHeads(t_hidden, t_weights, sorted(ids) if index == "grouped" else ids, seq_lens=seq_lens)
    mask = torch.arange(n) % 5 != 0
    component = Component(MultiTeacherDistill("jsd", beta=0.3, chunk_size=5, teachers=teachers), mask=mask,
                          normalize="sequence_mean")  # fmt: skip
    plan = Plan(seq_lens, {"kd": component})
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    return plan, Outputs(hidden=h, head_weight=w) if path == "hidden" else Outputs(logits=h @ w.T)


@pytest.mark.parametrize("path", ["hidden", "logits"])
@pytest.mark.parametrize("index", ["sequence", "grouped", "token"])
def test_no_syncs_and_op_counts_independent_of_the_sequences(index, path) -> None:
    totals = []
    for seq_lens, ids in LAYOUTS:
        with OpCounter() as building:
            plan, outputs = _step(seq_lens, ids, index, path)
            den = count_denominators([plan])
        with OpCounter() as ops:
            compute_loss(plan, outputs, den).loss.backward()
        assert building.num_syncs == 0 and ops.num_syncs == 0, (building.syncs, ops.syncs)
        totals.append(ops.total)
    assert totals[0] == totals[1]


class _MatmulRows(TorchDispatchMode):
    """Rows of every ``aten.mm`` whose inner dimension is ``width`` (the teachers' ``H_t``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.rows = width, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default or func is torch.ops.aten.mm.out:
            a = args[0]
            self.rows += a.shape[0] if a.shape[1] == self.width else 0
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("index, per_row", [("sequence", 1), ("grouped", 1), ("token", 3)])
def test_a_per_sequence_index_runs_each_row_against_its_own_head_only(index, per_row) -> None:
    seq_lens, ids = LAYOUTS[1]
    plan, outputs = _step(seq_lens, ids, index, "hidden")
    with _MatmulRows(H_T) as mm:
        compute_loss(plan, outputs).loss.backward()
    assert mm.rows == per_row * sum(seq_lens)


@pytest.mark.parametrize("index", ["sequence", "token"])
def test_the_fused_pass_allocates_nothing_of_n_by_v(index) -> None:
    n, v, chunk = 64, 96, 8
    hidden, weight, t_hidden, t_weights, g = _tensors(6, n, v, 3, dtype=torch.float32)
    seq_lens = [8] * 8
    ids = [2, 0, 1, 1, 0, 2, 0, 1]
    teachers = (TeacherHeads(t_hidden, t_weights, torch.tensor(_token_teacher(seq_lens, ids))) if index == "token"
                else TeacherHeads(t_hidden, t_weights, ids, seq_lens=seq_lens))  # fmt: skip
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    with MaxNumel() as sizes:
        loss, _ = linear_multi_distill(h, w, teachers, kind="reverse_kl", chunk_size=chunk)
        loss.backward()
    assert sizes.max_numel < n * v
    assert sizes.max_numel <= max(chunk * v, n * H, v * H, 3 * v * H_T)


@pytest.mark.parametrize("path", ["hidden", "logits"])
@pytest.mark.parametrize("index", ["sequence", "token"])
@pytest.mark.parametrize("garbage", [math.nan, math.inf])
def test_non_member_rows_may_hold_anything(index, path, garbage) -> None:
    seq_lens, ids = [3, 2, 4, 3], [1, 0, 2, 0]
    n, v = sum(seq_lens), 13
    hidden, weight, t_hidden, t_weights, _ = _tensors(7, n, v, 3)
    mask = torch.tensor([1, 0, 1, 0, 0, 1, 1, 0, 1, 1, 0, 1], dtype=torch.bool)
    off = (~mask).nonzero().squeeze(1)
    per_token = torch.tensor(_token_teacher(seq_lens, ids))
    results = []
    for dirty in (False, True):
        h, th, idx = hidden.clone(), t_hidden.clone(), per_token.clone()
        if dirty:
            h[off], th[off], idx[off] = garbage, garbage, torch.tensor([-1, 7, 3, -5, 99])
        if index == "token":
            teachers = TeacherHeads(th, t_weights, idx)
        else:
            teachers = TeacherHeads(th, t_weights, ids, seq_lens=seq_lens)
        objective = MultiTeacherDistill("reverse_kl", temperature=1.2, chunk_size=4, teachers=teachers)
        w = weight.clone().requires_grad_()
        x = (h.requires_grad_() if path == "hidden" else torch.where(mask[:, None], h @ w.detach().T,
                                                                      garbage).requires_grad_())  # fmt: skip
        outputs = Outputs(hidden=x, head_weight=w) if path == "hidden" else Outputs(logits=x)
        result = compute_loss(Plan(seq_lens, {"kd": Component(objective, mask=mask)}), outputs)
        leaves = [x, w] if path == "hidden" else [x]
        results.append([result.loss, *result.metrics.values(), *torch.autograd.grad(result.loss, leaves)])
    for clean, dirty in zip(*results, strict=True):
        assert torch.isfinite(dirty).all()
        torch.testing.assert_close(dirty, clean, rtol=0.0, atol=0.0)
    assert (results[1][-1 if path == "logits" else -2][off] == 0).all()


def test_step_denominators_make_two_bins_one() -> None:
    """Per-bin objectives under step denominators: two bins give the gradient of one bin holding both."""
    seq_lens, ids = [3, 4, 2, 5], [1, 0, 2, 1]
    n, v = sum(seq_lens), 11
    hidden, weight, t_hidden, t_weights, g = _tensors(8, n, v, 3)
    mask = torch.rand(n, generator=g) < 0.75
    w = weight.clone().requires_grad_()
    h = hidden.clone().requires_grad_()

    def plan(lo: int, hi: int, lens, teacher_ids) -> tuple[Plan, Outputs]:
        teachers = TeacherHeads(t_hidden[lo:hi], t_weights, teacher_ids, seq_lens=lens)
        comp = Component(MultiTeacherDistill("forward_kl", chunk_size=3, teachers=teachers), mask=mask[lo:hi],
                         normalize="sequence_mean")  # fmt: skip
        return Plan(lens, {"kd": comp}), Outputs(hidden=h[lo:hi], head_weight=w)

    whole = [plan(0, n, seq_lens, ids)]
    split = [plan(0, 7, seq_lens[:2], ids[:2]), plan(7, n, seq_lens[2:], ids[2:])]
    grads = []
    for bins in (whole, split):
        den = count_denominators([p for p, _ in bins])
        loss = sum(compute_loss(p, o, den).loss for p, o in bins)
        grads.append(torch.autograd.grad(loss, [h, w]))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------------
# Bad input, validation
# ---------------------------------------------------------------------------------------------------


def _bad(what: str):
    th, tw = torch.randn(5, 3), torch.randn(2, 7, 3)
    cases = {
        "weights dims": lambda: TeacherHeads(th, tw[0], [0, 1], seq_lens=[2, 3]),
        "weights empty": lambda: TeacherHeads(th, [], [0, 1], seq_lens=[2, 3]),
        "weights shapes": lambda: TeacherHeads(th, [tw[0], tw[1, :5]], [0, 1], seq_lens=[2, 3]),
        "H_t": lambda: TeacherHeads(torch.randn(5, 4), tw, [0, 1], seq_lens=[2, 3]),
        "index range": lambda: TeacherHeads(th, tw, [0, 2], seq_lens=[2, 3]),
        "index length": lambda: TeacherHeads(th, tw, [0, 1, 1], seq_lens=[2, 3]),
        "index bool": lambda: TeacherHeads(th, tw, [0, True], seq_lens=[2, 3]),
        "no seq_lens": lambda: TeacherHeads(th, tw, [0, 1]),
        "seq_lens sum": lambda: TeacherHeads(th, tw, [0, 1], seq_lens=[2, 2]),
        "index tensor shape": lambda: TeacherHeads(th, tw, torch.zeros(4, dtype=torch.long)),
        "index tensor float": lambda: TeacherHeads(th, tw, torch.zeros(5)),
        "tensor and seq_lens": lambda: TeacherHeads(th, tw, torch.zeros(5, dtype=torch.long), seq_lens=[5]),
        "teachers type": lambda: MultiTeacherDistill(teachers=th),
        "kind": lambda: MultiTeacherDistill("kl", teachers=TeacherHeads(th, tw, [0], seq_lens=[5])),
        "plan N": lambda: Plan([6], {"kd": Component(MultiTeacherDistill(teachers=TeacherHeads(
            th, tw, [0], seq_lens=[5])), mask=torch.ones(6, dtype=torch.bool))}),
        "plan seq_lens": lambda: Plan([1, 4], {"kd": Component(MultiTeacherDistill(teachers=TeacherHeads(
            th, tw, [0, 1], seq_lens=[2, 3])), mask=torch.ones(5, dtype=torch.bool))}),
        "student V": lambda: linear_multi_distill(torch.randn(5, 2), torch.randn(6, 2), TeacherHeads(
            th, tw, [0], seq_lens=[5])),
    }  # fmt: skip
    return cases[what]


@pytest.mark.parametrize(
    "what, error, match",
    [
        ("weights dims", ValueError, "weights must be"), ("weights empty", ValueError, "T must be"),
        ("weights shapes", ValueError, r"weights\[1\]"), ("H_t", ValueError, "teacher_hidden"),
        ("index range", ValueError, r"index must be in \[0, T=2\)"), ("index length", ValueError, "index holds 3"),
        ("index bool", TypeError, "index must be an int"), ("no seq_lens", ValueError, "needs seq_lens"),
        ("seq_lens sum", ValueError, "seq_lens sums to 4"), ("index tensor shape", ValueError, "index must have"),
        ("index tensor float", TypeError, "index must be an integer"), ("tensor and seq_lens", ValueError, "seq_lens"),
        ("teachers type", TypeError, "teachers must be a TeacherHeads"), ("kind", ValueError, "kind must be"),
        ("plan N", ValueError, "MultiTeacherDistill.*N=5"), ("plan seq_lens", ValueError, "own seq_lens"),
        ("student V", ValueError, "V=7"),
    ],
)  # fmt: skip
def test_bad_input_names_the_argument(what, error, match) -> None:
    with pytest.raises(error, match=match):
        _bad(what)()


def test_validate_finds_an_index_out_of_range_and_a_member_with_one_gets_nan() -> None:
    th, tw = torch.randn(4, 3), torch.randn(2, 6, 3)
    index = torch.tensor([0, 1, 2, -1])
    teachers = TeacherHeads(th, tw, index)
    with pytest.raises(ValueError, match=r"2 token\(s\) outside \[0, T=2\)"):
        teachers.validate()
    mask = torch.tensor([True, True, False, False])
    assert teachers.validate(mask) is teachers
    loss, _ = linear_multi_distill(torch.randn(4, 2), torch.randn(6, 2), teachers, loss_mask=mask | index.eq(2))
    assert loss.isnan()
    assert "T=2" in repr(teachers) and "per token" in repr(teachers)
