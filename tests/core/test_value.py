"""packloss.core.value: ValueLoss equals verl 0.9.1's own ``compute_value_loss`` (every ``loss_agg_mode``)
and OpenRLHF 0.11.2's own ``ValueLoss`` on padded rows built from the same packed sequences (loss,
gradient w.r.t. the values, metrics; over several bins with step denominators too), a per-sequence
reference over hypothesis packings (squared and Huber, every mode), GAE targets into a hand-written
gradient; sync-free, flat in S, NaN-safe off the members, float32 at least."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packloss import (
    Component,
    Outputs,
    PaddedLayout,
    Plan,
    compute_loss,
    count_denominators,
    gae_advantages,
    merge_metrics,
)
from packloss.core.value import ValueLoss
from packloss.testing import OpCounter
from tests.integrations.openrlhf.harness import ORL, needs_openrlhf

CLIP = 0.2


def _bin(lens, seed, holes=0.25, empty=None, dtype=torch.float64):
    """Packed streams of sequences ``lens`` (values drawn so that some clip at ε = 0.2) and their
    right-padded ``[B, T]`` layout; sequence ``empty`` has no member."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    old = torch.randn(n, generator=g, dtype=torch.float64)
    values = (old + 0.6 * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    returns = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) > holes
    if empty is not None:
        start = sum(lens[:empty])
        mask[start : start + lens[empty]] = False
    attention = torch.arange(max(lens)) < torch.tensor(lens)[:, None]  # [B, T]
    layout = PaddedLayout.from_attention_mask(attention, lens)
    return SimpleNamespace(lens=list(lens), values=values, old=old.to(dtype), returns=returns.to(dtype), mask=mask,
                           layout=layout)  # fmt: skip


def _plan(b, loss, part=None, **component):
    """The plan of ``b`` (or of its sequences ``part``, a list of indices) with one ``critic`` component."""
    if part is None:
        lens, index = b.lens, slice(None)
    else:
        starts = [sum(b.lens[:i]) for i in range(len(b.lens))]
        lens = [b.lens[i] for i in part]
        index = torch.cat([torch.arange(starts[i], starts[i] + b.lens[i]) for i in part])
    plan = Plan(lens, {"critic": Component(loss, mask=b.mask[index], **component)}, returns=b.returns[index],
                old_values=b.old[index])  # fmt: skip
    return plan, index


def _packloss(b, loss, parts=None, **component):
    """Loss, gradient w.r.t. ``b.values`` and merged metrics over the bins ``parts`` (step denominators)."""
    bins = [_plan(b, loss, part, **component) for part in (parts or [None])]
    den = count_denominators([p for p, _ in bins]) if parts else None
    results = [compute_loss(p, Outputs(values=b.values[i]), den) for p, i in bins]
    total = sum(r.loss for r in results)
    (grad,) = torch.autograd.grad(total, b.values)
    return total.detach(), grad, merge_metrics(results)[0]


def _padded(b, x):
    return b.layout.unpack(x)  # [B, T], zero padding; autograd flows back to the packed values


# ---------------------------------------------------------------------------------------------------
# verl's compute_value_loss
# ---------------------------------------------------------------------------------------------------

VERL_MODES = {
    "token-mean": ({"normalize": "token"}, {}),
    "seq-mean-token-mean": ({"normalize": "sequence_mean"}, {}),
    "seq-mean-token-sum": ({"normalize": "sequence_sum"}, {}),
    "token-sum": ({"normalize": "constant", "constant": 1.0}, {}),
    # the trainer's global batch size B and scale factor L: the constant B · L
    "seq-mean-token-sum-norm": ({"normalize": "constant", "constant": 6 * 7.0}, {"global_batch_size": 6,
                                                                                 "loss_scale_factor": 7}),
}  # fmt: skip
LENS = [5, 17, 1, 9, 12, 3]


def _verl(b, mode, **kwargs):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    verl_f = pytest.importorskip("verl.utils.torch_functional")
    mask = _padded(b, b.mask)
    loss, clipfrac = core_algos.compute_value_loss(vpreds=_padded(b, b.values), returns=_padded(b, b.returns),
                                                   values=_padded(b, b.old), response_mask=mask, cliprange_value=CLIP,
                                                   loss_agg_mode=mode, **kwargs)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, b.values)
    vpred_mean = verl_f.masked_mean(_padded(b, b.values).detach(), mask)
    return loss.detach(), grad, {"critic/vf_clipfrac": clipfrac, "critic/vpred_mean": vpred_mean}


# verl divides a sequence's token sum and its masked means by (count + 1e-8): relative 1e-8 at most
TOL = {"rtol": 1e-7, "atol": 1e-10}


@pytest.mark.parametrize("mode", sorted(VERL_MODES))
def test_equals_verls_compute_value_loss(mode):
    component, kwargs = VERL_MODES[mode]
    b = _bin(LENS, seed=1, empty=2)
    loss, grad, metrics = _packloss(b, ValueLoss(clip=CLIP), **component)
    want_loss, want_grad, want_metrics = _verl(b, mode, **kwargs)
    assert 0 < want_metrics["critic/vf_clipfrac"] < 1  # both branches taken
    torch.testing.assert_close(loss, want_loss, **TOL)
    torch.testing.assert_close(grad, want_grad, **TOL)
    for key, value in want_metrics.items():
        torch.testing.assert_close(metrics[key].double(), value.double(), **TOL)
    if mode == "token-mean":  # the engine's loss metric is verl's vf_loss
        torch.testing.assert_close(metrics["critic/loss"], want_loss, **TOL)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_bins_with_step_denominators_equal_verl_on_the_whole_batch(mode):
    """Three bins of a shuffled packing: their summed loss and gradient are verl's over the whole batch
    and the sum of verl's micro-batch losses under its global normalisation (``batch_num_tokens``,
    ``global_batch_size`` = the sequences with members, which verl's ``seq_mask`` counts)."""
    component, _ = VERL_MODES[mode]
    b = _bin(LENS, seed=2, empty=4)
    parts = [[5, 0], [3], [1, 4, 2]]
    loss, grad, metrics = _packloss(b, ValueLoss(clip=CLIP), parts, **component)
    want_loss, want_grad, want_metrics = _verl(b, mode)
    torch.testing.assert_close(loss, want_loss, **TOL)
    torch.testing.assert_close(grad, want_grad, **TOL)
    for key, value in want_metrics.items():
        torch.testing.assert_close(metrics[key].double(), value.double(), **TOL)
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    tokens, seqs = int(b.mask.sum()), len(LENS) - 1
    micro = 0
    for part in parts:
        rows = torch.tensor(part)
        pad = {k: _padded(b, x)[rows] for k, x in (("v", b.values), ("r", b.returns), ("o", b.old), ("m", b.mask))}
        micro = micro + core_algos.compute_value_loss(pad["v"], pad["r"], pad["o"], pad["m"], CLIP, mode,
                                                      batch_num_tokens=tokens, global_batch_size=seqs)[0]  # fmt: skip
    (micro_grad,) = torch.autograd.grad(micro, b.values)
    torch.testing.assert_close(loss, micro.detach(), **TOL)
    torch.testing.assert_close(grad, micro_grad, **TOL)


# ---------------------------------------------------------------------------------------------------
# OpenRLHF's ValueLoss
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("clip", [None, CLIP])
@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("parts", [None, [[4, 1], [0, 2, 5], [3]]])
@needs_openrlhf
def test_equals_openrlhfs_value_loss(clip, token_level, parts):
    """One bin against OpenRLHF on the whole batch; several bins with step denominators against the
    sum of OpenRLHF's micro-batch losses under its global normalisation (``batch_num_tokens`` /
    ``global_batch_size``)."""
    loss_module = ORL
    b = _bin(LENS, seed=3, empty=1)
    normalize = "token" if token_level else "sequence_mean"
    loss, grad, metrics = _packloss(b, ValueLoss(clip=clip), parts, normalize=normalize)
    peer = loss_module.ValueLoss(clip_eps=clip, token_level_loss=token_level)
    pad = {k: _padded(b, x) for k, x in (("v", b.values), ("r", b.returns), ("o", b.old), ("m", b.mask))}
    if parts is None:
        want = peer(pad["v"], pad["o"], pad["r"], action_mask=pad["m"])
    else:
        tokens, seqs = float(b.mask.sum()), float(len(LENS) - 1)
        want = sum(peer(*(pad[k][torch.tensor(p)] for k in "vor"), action_mask=pad["m"][torch.tensor(p)],
                        batch_num_tokens=tokens, global_batch_size=seqs) for p in parts)  # fmt: skip
    (want_grad,) = torch.autograd.grad(want, b.values)
    # OpenRLHF clips as o + clamp(v − o): a rounding from verl's clamp(v); the same gradient
    torch.testing.assert_close(loss, want.detach(), **TOL)
    torch.testing.assert_close(grad, want_grad, **TOL)
    member_values = b.values.detach()[b.mask]
    torch.testing.assert_close(metrics["critic/vpred_mean"], member_values.mean(), rtol=1e-12, atol=1e-12)
    assert ("critic/vf_clipfrac" in metrics) == (clip is not None)


# ---------------------------------------------------------------------------------------------------
# A per-sequence reference
# ---------------------------------------------------------------------------------------------------


def _rho(x, loss, delta):
    if loss == "huber" and abs(float(x.detach())) > delta:
        return delta * (x.abs() - delta / 2)
    return x * x / 2


def _reference(b, clip, loss, delta, coef, weights, mode, constant):
    """The loss token by token and sequence by sequence (autograd through 0-d tensors)."""
    sums, counts, start = [], [], 0
    for n in b.lens:
        total, count = 0.0, 0
        for t in range(start, start + n):
            if not b.mask[t] or weights[t] == 0:
                continue
            v, r = b.values[t], float(b.returns[t])
            value = float(v.detach())
            term = _rho(v - r, loss, delta)
            if clip is not None:
                lo, hi = float(b.old[t]) - clip, float(b.old[t]) + clip
                clipped_v = v if lo <= value <= hi else torch.tensor(min(max(value, lo), hi), dtype=v.dtype)
                clipped = _rho(clipped_v - r, loss, delta)
                if float(clipped.detach()) > float(term.detach()):
                    term = clipped
            total, count = total + coef * float(weights[t]) * term, count + 1
        sums.append(total)
        counts.append(count)
        start += n
    seqs = max(sum(c > 0 for c in counts), 1)
    if mode == "token":
        return sum(sums) / max(sum(counts), 1)
    if mode == "sequence_mean":
        return sum(s / c for s, c in zip(sums, counts, strict=True) if c) / seqs
    if mode == "sequence_sum":
        return sum(sums) / seqs
    return sum(sums) / constant


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 9), min_size=1, max_size=6), seed=st.integers(0, 2**31 - 1),
       clip=st.sampled_from([None, 0.2, 1.0]), loss=st.sampled_from(["squared", "huber"]),
       delta=st.sampled_from([0.3, 1.0]), coef=st.sampled_from([1.0, 0.25]),
       mode=st.sampled_from(["token", "sequence_mean", "sequence_sum", "constant"]))  # fmt: skip
def test_equals_the_per_sequence_reference(lens, seed, clip, loss, delta, coef, mode):
    b = _bin(lens, seed)
    g = torch.Generator().manual_seed(seed)
    weights = torch.tensor([0.0, 0.5, 1.0, 2.0], dtype=torch.float64)[torch.randint(0, 4, (sum(lens),), generator=g)]
    delta = delta if loss == "huber" else 1.0
    constant = {"constant": 3.0} if mode == "constant" else {}
    objective = ValueLoss(clip=clip, loss=loss, huber_delta=delta, coef=coef)
    plan = Plan(lens, {"v": Component(objective, mask=b.mask, weights=weights, normalize=mode, **constant)},
                returns=b.returns, old_values=b.old)  # fmt: skip
    result = compute_loss(plan, Outputs(values=b.values))
    want = _reference(b, clip, loss, delta, coef, weights, mode, 3.0)
    torch.testing.assert_close(result.loss, torch.as_tensor(want, dtype=torch.float64).detach(), rtol=1e-12, atol=1e-12)
    attached = isinstance(want, torch.Tensor) and want.requires_grad
    want_grad = torch.autograd.grad(want, b.values)[0] if attached else torch.zeros_like(b.values)
    (grad,) = torch.autograd.grad(result.loss, b.values)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)


def test_huber_is_quadratic_inside_delta_and_linear_outside():
    """By hand: δ = 0.5, errors 0.2 (quadratic: 0.02), −2 (linear: 0.5 · (2 − 0.25) = 0.875)."""
    values = torch.tensor([1.2, -2.0], dtype=torch.float64, requires_grad=True)
    plan = Plan([2], {"v": Component(ValueLoss(loss="huber", huber_delta=0.5), mask=torch.ones(2, dtype=torch.bool),
                                     normalize="constant", constant=1.0)},
                returns=torch.tensor([1.0, 0.0], dtype=torch.float64))  # fmt: skip
    result = compute_loss(plan, Outputs(values=values))
    assert result.loss.item() == pytest.approx(0.02 + 0.875, abs=1e-12)
    result.loss.backward()
    assert values.grad.tolist() == pytest.approx([0.2, -0.5], abs=1e-12)  # x inside, δ · sign(x) outside


# ---------------------------------------------------------------------------------------------------
# GAE targets
# ---------------------------------------------------------------------------------------------------


def test_gae_returns_into_the_value_loss_give_the_hand_written_gradient():
    """``gae_advantages`` on the rollout values → returns → ``ValueLoss(clip=0.2)``, token mean; the
    gradient by hand, sequence by sequence: GAE's recursion over the members, then
    ``(v − R) / M`` where the unclipped branch is taken and 0 where the clipped one is."""
    gamma, lam = 0.9, 0.8
    b = _bin([6, 1, 11, 4], seed=4, holes=0.2)
    g = torch.Generator().manual_seed(5)
    rewards = torch.randn(sum(b.lens), generator=g, dtype=torch.float64)
    _, returns = gae_advantages(rewards, b.old, b.lens, b.mask, gamma=gamma, lam=lam)
    plan = Plan(b.lens, {"critic": Component(ValueLoss(clip=CLIP), mask=b.mask)}, returns=returns, old_values=b.old)
    (grad,) = torch.autograd.grad(compute_loss(plan, Outputs(values=b.values)).loss, b.values)

    r, o, v, m = rewards.tolist(), b.old.tolist(), b.values.tolist(), b.mask.tolist()
    members, want, start = sum(m), [0.0] * len(v), 0
    for n in b.lens:
        next_value = next_adv = 0.0
        for t in reversed(range(start, start + n)):
            if not m[t]:
                continue
            next_adv = r[t] + gamma * next_value - o[t] + gamma * lam * next_adv
            next_value, ret = o[t], next_adv + o[t]
            clipped = min(max(v[t], o[t] - CLIP), o[t] + CLIP)
            want[t] = 0.0 if (clipped - ret) ** 2 > (v[t] - ret) ** 2 else (v[t] - ret) / members
        start += n
    assert any(w == 0.0 for w, k in zip(want, m, strict=True) if k)  # some clipped
    torch.testing.assert_close(grad, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------------
# Contracts: syncs, op counts, non-members, dtypes, errors
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", ["token", "sequence_mean"])
@pytest.mark.parametrize("loss", ["squared", "huber"])
def test_sync_free_and_op_count_flat_in_the_number_of_sequences(normalize, loss):
    totals = {}
    for num_seqs in (4, 64):
        b = _bin([256 // num_seqs] * num_seqs, seed=num_seqs, dtype=torch.float32)
        plan, _ = _plan(b, ValueLoss(clip=CLIP, loss=loss), normalize=normalize)
        den = count_denominators([plan])
        with OpCounter() as counter:
            compute_loss(plan, Outputs(values=b.values), den).loss.backward()
        assert counter.num_syncs == 0, counter.syncs
        totals[num_seqs] = counter.total
    assert totals[4] == totals[64], totals


@pytest.mark.parametrize("per_sequence_metrics", [False, True])
def test_non_member_nan_and_inf_change_nothing(per_sequence_metrics):
    b = _bin(LENS, seed=6)
    clean, _ = _plan(b, ValueLoss(clip=CLIP, loss="huber"), normalize="sequence_mean")
    poison = torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.float64).repeat(sum(LENS))[: sum(LENS)]
    values = torch.where(b.mask, b.values.detach(), poison).requires_grad_()
    dirty = Plan(b.lens, clean.components, returns=torch.where(b.mask, b.returns, poison.roll(1)),
                 old_values=torch.where(b.mask, b.old, poison.roll(2)))  # fmt: skip
    results, grads = [], []
    for plan, v in ((clean, b.values), (dirty, values)):
        result = compute_loss(plan, Outputs(values=v), per_sequence_metrics=per_sequence_metrics)
        results.append(result)
        grads.append(torch.autograd.grad(result.loss, v)[0])
    assert torch.equal(results[0].loss, results[1].loss) and torch.isfinite(results[1].loss)
    assert torch.equal(grads[1], torch.where(b.mask, grads[0], 0.0))
    for key, value in results[0].metrics.items():
        assert torch.equal(results[1].metrics[key], value), key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_computed_in_at_least_float32(dtype):
    b = _bin(LENS, seed=7, dtype=dtype)
    plan, _ = _plan(b, ValueLoss(clip=CLIP))
    result = compute_loss(plan, Outputs(values=b.values))
    want = torch.promote_types(dtype, torch.float32)
    assert result.loss.dtype == want and result.per_token["critic"].dtype == want
    assert result.metrics["critic/loss"].dtype == result.metrics["critic/vpred_mean"].dtype == want
    (grad,) = torch.autograd.grad(result.loss, b.values)
    assert grad.dtype == dtype and torch.isfinite(grad).all()


def test_per_sequence_metrics_are_each_sequences_own():
    b = _bin([3, 4, 2], seed=8, holes=0.0)
    plan, _ = _plan(b, ValueLoss(clip=CLIP))
    result = compute_loss(plan, Outputs(values=b.values), per_sequence_metrics=True)
    per_seq = torch.stack([part.mean() for part in b.values.detach().split(b.lens)])
    torch.testing.assert_close(result.metrics["critic/vpred_mean"], per_seq, rtol=1e-12, atol=1e-12)
    assert result.counts["critic/vf_clipfrac"].tolist() == [3, 4, 2]


def test_missing_streams_are_named():
    mask, x = torch.ones(3, dtype=torch.bool), torch.zeros(3)
    with pytest.raises(ValueError, match="component 'critic' needs the plan's returns"):
        Plan([3], {"critic": Component(ValueLoss(), mask=mask)})
    with pytest.raises(ValueError, match=r"component 'critic' needs the plan's old_values .* ValueLoss\(clip=0.2\)"):
        Plan([3], {"critic": Component(ValueLoss(clip=0.2), mask=mask)}, returns=x)
    plan = Plan([3], {"critic": Component(ValueLoss(), mask=mask)}, returns=x)  # unclipped: no old values needed
    with pytest.raises(ValueError, match="component 'critic' needs outputs.values"):
        compute_loss(plan, Outputs(logprobs=x))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"clip": 0.0}, ValueError, r"ValueLoss.clip must be > 0 \(None: no clipping\)"),
    ({"clip": -0.5}, ValueError, "ValueLoss.clip must be > 0"),
    ({"clip": math.inf}, ValueError, "ValueLoss.clip must be finite"),
    ({"clip": "0.2"}, TypeError, "ValueLoss.clip must be a number"),
    ({"loss": "l1"}, ValueError, "ValueLoss.loss must be one of"),
    ({"loss": "huber", "huber_delta": 0.0}, ValueError, "ValueLoss.huber_delta must be > 0"),
    ({"huber_delta": 2.0}, ValueError, "huber_delta is only used with loss='huber'"),
    ({"coef": -1.0}, ValueError, "ValueLoss.coef must be >= 0"),
])  # fmt: skip
def test_bad_parameters_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        ValueLoss(**kwargs)
