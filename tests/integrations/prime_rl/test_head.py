"""packloss.integrations.prime_rl.head (prime-rl's ``FusedOutputLinear`` / ``GemmaFusedOutputLinear`` on the
fused head) against a reference written here from prime-rl's semantics: the full ``[B, S, V]`` logits in
float64, softcapped (Gemma), divided by each token's temperature, ``log_softmax``, gathered at the labels;
entropy ``−Σ p log p``; gradients by plain autograd through it. Nothing here calls packloss's head to
build an expectation. prime-rl itself is not installable here."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT
from packloss.integrations.prime_rl.head import FusedOutputLinear, GemmaFusedOutputLinear
from packloss.testing import OpCounter

F64 = torch.float64
IGNORE = -100
DOC = ROOT / "docs" / "integrations" / "prime_rl.md"


def reference(hidden, weight, labels, temperature, softcap=None):
    """``(logprobs [B, S], entropy [B, S])`` in float64 from the full logits; an ignored label's log-prob is 0."""
    z = hidden.to(F64) @ weight.to(F64).T  # [B, S, V]
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    log_p = torch.log_softmax(z / temperature.to(F64)[..., None], dim=-1)  # [B, S, V]
    valid = labels != IGNORE  # [B, S]
    picked = log_p.gather(-1, torch.where(valid, labels, 0)[..., None]).squeeze(-1)  # [B, S]
    return torch.where(valid, picked, 0.0), -(log_p.exp() * log_p).sum(-1)


def make_head(h, v, chunk_size, weight, softcap=None, **kwargs):
    if softcap is None:
        head = FusedOutputLinear(h, v, chunk_size, **kwargs)
    else:
        head = GemmaFusedOutputLinear(h, v, chunk_size, softcap, **kwargs)
    head.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    return head


@st.composite
def cases(draw):
    b, s = draw(st.integers(1, 4)), draw(st.sampled_from([0, 1, 1, 2, 3, 5, 7, 10]))
    h, v = draw(st.integers(1, 8)), draw(st.integers(1, 70))
    n = b * s
    # at most ~7 × 7 blocks per pass: both sides below and above N and V, rarely dividing them
    chunk = draw(st.integers(max(1, n // 6), n + 5))
    vocab_chunk = draw(st.none() | st.integers(max(1, v // 6), v + 5))
    return dict(
        b=b, s=s, h=h, v=v, chunk=chunk, vocab_chunk=vocab_chunk,
        softcap=draw(st.none() | st.floats(0.5, 10.0)),
        entropy_grad=draw(st.booleans()),
        train_weight=draw(st.booleans()),
        ignored_rows=draw(st.lists(st.booleans(), min_size=b, max_size=b)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


def draw_inputs(b, s, h, v, seed, ignored_rows=(), dtype=F64):
    g = torch.Generator().manual_seed(seed)
    hidden = (2 * torch.randn(b, s, h, generator=g, dtype=F64)).to(dtype)  # [B, S, H]
    weight = torch.randn(v, h, generator=g, dtype=F64).to(dtype)  # [V, H]
    labels = torch.randint(0, v, (b, s), generator=g)  # [B, S]
    rows = torch.tensor(list(ignored_rows) or [False] * b, dtype=torch.bool)  # [B]
    labels = torch.where(rows[:, None], IGNORE, labels)  # [B, S]
    temperature = 0.3 + 2.7 * torch.rand(b, s, generator=g, dtype=torch.float32)  # [B, S]
    g_lp, g_ent = torch.randn(b, s, generator=g, dtype=F64), torch.randn(b, s, generator=g, dtype=F64)
    return hidden, weight, labels, temperature, g_lp, g_ent


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_values_and_gradients_equal_the_full_logits_reference(case):
    b, s, h, v = case["b"], case["s"], case["h"], case["v"]
    hidden, weight, labels, temperature, g_lp, g_ent = draw_inputs(b, s, h, v, case["seed"], case["ignored_rows"])
    weight.requires_grad_(case["train_weight"])
    head = make_head(h, v, case["chunk"], weight, case["softcap"], vocab_chunk_size=case["vocab_chunk"],
                     entropy_grad=case["entropy_grad"])  # fmt: skip
    h1 = hidden.clone().requires_grad_(True)
    out = head(h1, labels, temperature)
    assert set(out) == {"logprobs", "entropy"} and out.get("logits") is None
    assert out["logprobs"].shape == out["entropy"].shape == (b, s)
    assert out["logprobs"].dtype == out["entropy"].dtype == F64
    assert out["entropy"].requires_grad == case["entropy_grad"]  # detached by default, as prime-rl's

    h0, w0 = hidden.clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    lp0, ent0 = reference(h0, w0, labels, temperature, case["softcap"])
    torch.testing.assert_close(out["logprobs"], lp0, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out["entropy"], ent0, rtol=1e-10, atol=1e-12)

    upstream = (g_lp * out["logprobs"]).sum()
    expected = (g_lp * lp0).sum()
    if case["entropy_grad"]:
        upstream, expected = upstream + (g_ent * out["entropy"]).sum(), expected + (g_ent * ent0).sum()
    upstream.backward()
    expected.backward()
    torch.testing.assert_close(h1.grad, h0.grad, rtol=1e-9, atol=1e-12)
    if case["train_weight"]:
        torch.testing.assert_close(head.weight.grad, w0.grad, rtol=1e-9, atol=1e-12)
    else:
        assert head.weight.grad is None


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_give_float32_outputs_close_to_the_reference(dtype, softcap):
    b, s, h, v = 3, 17, 16, 300
    hidden, weight, labels, temperature, g_lp, _ = draw_inputs(b, s, h, v, seed=1, dtype=dtype)
    head = make_head(h, v, 7, weight.requires_grad_(True), softcap, vocab_chunk_size=64)
    h1 = hidden.clone().requires_grad_(True)
    out = head(h1, labels, temperature)
    assert out["logprobs"].dtype == out["entropy"].dtype == torch.float32
    (g_lp.float() * out["logprobs"]).sum().backward()
    assert h1.grad.dtype == head.weight.grad.dtype == dtype

    h0, w0 = hidden.to(F64).requires_grad_(True), weight.detach().to(F64).requires_grad_(True)
    lp0, ent0 = reference(h0, w0, labels, temperature, softcap)
    (g_lp * lp0).sum().backward()
    torch.testing.assert_close(out["logprobs"], lp0.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["entropy"], ent0.float(), rtol=1e-5, atol=1e-5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h1.grad.to(F64), h0.grad, **tol)
    torch.testing.assert_close(head.weight.grad.to(F64), w0.grad, **tol)


def test_ignored_rows_may_hold_nan_without_touching_the_gradient():
    b, s, h, v = 3, 6, 5, 40
    hidden, weight, labels, temperature, g_lp, _ = draw_inputs(b, s, h, v, seed=2, ignored_rows=[False, True, False])
    head = make_head(h, v, 4, weight.requires_grad_(True), vocab_chunk_size=9)
    poisoned = hidden.clone()
    poisoned[1] = float("nan")
    h1 = poisoned.requires_grad_(True)
    out = head(h1, labels, temperature)
    (g_lp * out["logprobs"]).sum().backward()

    h0, w0 = hidden.clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    lp0, _ = reference(h0, w0, labels, temperature)
    (g_lp * lp0).sum().backward()
    assert (out["logprobs"][1] == 0).all() and (h1.grad[1] == 0).all()
    torch.testing.assert_close(out["logprobs"], lp0, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h1.grad, h0.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(head.weight.grad, w0.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_forward_and_backward_are_sync_free(entropy_grad, softcap):
    hidden, weight, labels, temperature, g_lp, g_ent = draw_inputs(2, 9, 8, 50, seed=3, ignored_rows=[False, True])
    head = make_head(8, 50, 5, weight.float().requires_grad_(True), softcap, vocab_chunk_size=16,
                     entropy_grad=entropy_grad)  # fmt: skip
    h1 = hidden.float().requires_grad_(True)
    with OpCounter() as ops:
        out = head(h1, labels, temperature)
        loss = (g_lp.float() * out["logprobs"]).sum()
        if entropy_grad:
            loss = loss + (g_ent.float() * out["entropy"]).sum()
        loss.backward()
    assert ops.num_syncs == 0, ops.syncs
    assert ops.ops["aten.mm"] > 0  # the counter saw the head's blocks


@pytest.mark.parametrize("chunk, vocab_chunk, blocks", [(3, 16, 4 * 4), (10, 50, 1), (4, 7, 3 * 8), (100, 1000, 1)])
def test_chunk_sizes_set_the_token_by_vocab_blocks(chunk, vocab_chunk, blocks):
    """``chunk_size`` tokens of the flattened ``B·S`` by ``vocab_chunk_size`` rows: one matmul per block."""
    hidden, weight, labels, temperature, _, _ = draw_inputs(2, 5, 4, 50, seed=5, dtype=torch.float32)
    head = make_head(4, 50, chunk, weight, vocab_chunk_size=vocab_chunk)
    with OpCounter() as ops, torch.no_grad():
        head(hidden, labels, temperature)
    assert ops.ops["aten.mm"] == blocks, dict(ops.ops)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_a_plain_linear_state_dict_loads(softcap):
    plain = torch.nn.Linear(6, 30, bias=False)
    head = FusedOutputLinear(6, 30, 4) if softcap is None else GemmaFusedOutputLinear(6, 30, 4, softcap)
    assert set(head.state_dict()) == {"weight"}
    head.load_state_dict(plain.state_dict(), strict=True)
    torch.nn.Linear(6, 30, bias=False).load_state_dict(head.state_dict(), strict=True)
    hidden, _, labels, temperature, _, _ = draw_inputs(2, 3, 6, 30, seed=4, dtype=torch.float32)
    lp0, ent0 = reference(hidden, plain.weight.detach(), labels, temperature, softcap)
    out = head(hidden, labels, temperature)
    torch.testing.assert_close(out["logprobs"], lp0.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["entropy"], ent0.float(), rtol=1e-5, atol=1e-5)


def _call(**changes):
    args = dict(hidden_states=torch.randn(2, 3, 4), labels=torch.randint(0, 9, (2, 3)), temperature=torch.ones(2, 3))
    args.update(changes)
    return FusedOutputLinear(4, 9, 2)(args["hidden_states"], args["labels"], args["temperature"])


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: _call(labels=None), TypeError, "labels"),
        (lambda: _call(temperature=None), TypeError, "temperature"),
        (lambda: _call(hidden_states=torch.randn(6, 4)), ValueError, "hidden_states must be 3-D"),
        (lambda: _call(hidden_states=torch.ones(2, 3, 4, dtype=torch.long)), TypeError, "hidden_states"),
        (lambda: _call(hidden_states=[[0.0]]), TypeError, "hidden_states"),
        (lambda: _call(hidden_states=torch.randn(2, 3, 5)), ValueError, "hidden_states has H = 5"),
        (lambda: _call(labels=torch.zeros(2, 4, dtype=torch.long)), ValueError, "labels must have shape"),
        (lambda: _call(labels=torch.zeros(6, dtype=torch.long)), ValueError, "labels must have shape"),
        (lambda: _call(labels=torch.zeros(2, 3)), TypeError, "labels must be an integer"),
        (lambda: _call(labels=torch.zeros(2, 3, dtype=torch.bool)), TypeError, "labels must be an integer"),
        (lambda: _call(temperature=torch.ones(6)), ValueError, "temperature must have shape"),
        (lambda: _call(temperature=1.0), TypeError, "temperature must be a torch.Tensor"),
        (lambda: _call(temperature=torch.ones(2, 3, dtype=torch.long)), TypeError, "temperature"),
        (lambda: _call(labels=torch.zeros(2, 3, dtype=torch.long, device="meta")), ValueError, "labels"),
        (lambda: FusedOutputLinear(4, 9, 0), ValueError, "chunk_size"),
        (lambda: FusedOutputLinear(4, 9, 2.0), TypeError, "chunk_size"),
        (lambda: FusedOutputLinear(4, 9, True), TypeError, "chunk_size"),
        (lambda: FusedOutputLinear(4, 9, 2, vocab_chunk_size=0), ValueError, "vocab_chunk_size"),
        (lambda: FusedOutputLinear(4, 9, 2, entropy_grad=1), TypeError, "entropy_grad"),
        (lambda: FusedOutputLinear(4, 9, 2, ignore_index=-1.0), TypeError, "ignore_index"),
        (lambda: GemmaFusedOutputLinear(4, 9, 2, 0.0), ValueError, "softcap"),
        (lambda: GemmaFusedOutputLinear(4, 9, 2, float("inf")), ValueError, "softcap"),
        (lambda: GemmaFusedOutputLinear(4, 9, 2, None), TypeError, "softcap"),
    ],
)
def test_bad_inputs_raise_named_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------------------------------------------
# The documentation's snippet (the whole page also runs in test_current.py)
# ---------------------------------------------------------------------------------------------------


def _snippet() -> dict:
    section = DOC.read_text().split("## The fused output head", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    namespace: dict = {}
    exec(compile(block, str(DOC), "exec"), namespace)
    return namespace


def test_doc_snippet_swaps_the_head_and_keeps_its_weight():
    ns = _snippet()
    head = ns["model"].lm_head
    assert type(head) is FusedOutputLinear and head.weight is ns["weight"] and head.chunk_size == 8
    lp0, ent0 = reference(ns["hidden"].detach(), ns["weight"].detach(), ns["labels"], ns["temperatures"])
    torch.testing.assert_close(ns["out"]["logprobs"], lp0.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ns["out"]["entropy"], ent0.float(), rtol=1e-5, atol=1e-5)
    assert ns["hidden"].grad.abs().sum() > 0 and head.weight.grad.abs().sum() > 0


class _GemmaLike(torch.nn.Linear):
    """The attributes prime-rl's GemmaFusedOutputLinear has (prime-rl is not installed here)."""

    def __init__(self, h, v, chunk_size, softcap):
        super().__init__(h, v, bias=False)
        self.chunk_size, self.softcap = chunk_size, softcap


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_doc_swap_keeps_chunk_size_softcap_and_device(device):
    swap = _snippet()["use_packloss_head"]
    with torch.device(device):
        model = torch.nn.Module()
        model.model = torch.nn.Module()
        model.model.embed = torch.nn.Embedding(30, 6)
        model.lm_head = _GemmaLike(6, 30, 11, 7.5)
    model.lm_head.weight = model.model.embed.weight  # tied
    swap(model)
    head = model.lm_head
    assert type(head) is GemmaFusedOutputLinear and head.softcap == 7.5 and head.chunk_size == 11
    assert head.weight is model.model.embed.weight and head.weight.device.type == device
