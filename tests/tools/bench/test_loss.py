"""packloss.tools.bench.loss: the ``loss`` suite's rows from ``packloss bench loss --quick`` (schema,
sync-free and flat eager rows, op counts), the native and compat-floor steps against what they stand for,
and the summary figures."""

from __future__ import annotations

import json

import pytest
import torch

from packloss.testing import OpCounter
from packloss.tools.bench import loss as loss_suite

ROW_FIELDS = {
    "suite": str,
    "shape": str,
    "archetype": str,
    "num_tokens": int,
    "num_seqs": int,
    "variant": str,
    "time_ms": float,
    "speedup_vs_reference": float,
}
OPTIONAL_FIELDS = {"aten_ops": int, "syncs": int, "first_call_s": float, "graphs": int, "peak_bytes": int}


def test_bench_json_schema(quick_run):
    _, _, text = quick_run
    payload = json.loads(text)
    assert set(payload) == {"machine", "options", "suites"}
    machine = payload["machine"]
    for key in ("platform", "cpu_model", "cpu_cores", "torch", "device", "date"):
        assert key in machine
    assert machine["torch"] == torch.__version__ and machine["device"] == "cpu"
    assert payload["options"]["quick"] is True
    result = payload["suites"]["loss"]
    assert "error" not in result
    sched = loss_suite.schedule(quick=True)
    rows = result["rows"]
    # reference, compat, compat_floor and eager for every archetype and packing, + compiled hot
    expected = len(loss_suite.ARCHETYPES) * len(sched.seq_counts) * 4 + len(sched.seq_counts)
    assert len(rows) == expected
    for row in rows:
        for key, kind in ROW_FIELDS.items():
            assert isinstance(row[key], kind), (key, row)
        for key, kind in OPTIONAL_FIELDS.items():
            assert row[key] is None or isinstance(row[key], kind), (key, row)
        assert row["time_ms"] > 0
        assert row["variant"] in loss_suite.VARIANTS and row["archetype"] in loss_suite.ARCHETYPES
        if row["variant"] == "compiled":
            assert row["first_call_s"] > 0 and row["graphs"] >= 1
        else:
            assert row["aten_ops"] > 0 and row["syncs"] >= 0
    assert {r["num_seqs"] for r in rows} == set(sched.seq_counts)
    assert any(r["variant"] == "compiled" for r in rows)
    for archetype in loss_suite.ARCHETYPES:
        assert set(result["summary"][archetype]) >= {f"eager_speedup_at_{max(sched.seq_counts)}"}


def test_bench_native_rows_are_sync_free_and_flat_in_op_count(quick_run):
    rows = json.loads(quick_run[2])["suites"]["loss"]["rows"]
    for archetype in loss_suite.ARCHETYPES:
        eager = [r for r in rows if (r["archetype"], r["variant"]) == (archetype, "eager")]
        assert {r["syncs"] for r in eager} == {0}
        assert len({r["aten_ops"] for r in eager}) == 1  # independent of sequences per bin
        # prime-rl's list API over split views: no sync, no per-sequence op (one cat per list without grad).
        # It builds its layout inside the call, where repeat_interleave of one length adds a view and
        # an expand: flat from 2 sequences on.
        for variant in ("compat", "compat_floor"):
            mine = [r for r in rows if (r["archetype"], r["variant"]) == (archetype, variant)]
            assert {r["syncs"] for r in mine} == {0}
            assert len({r["aten_ops"] for r in mine if r["num_seqs"] > 1}) == 1, (
                variant,
                [r["aten_ops"] for r in mine],
            )


def test_bench_op_counts_equal_the_counters_own(quick_run):
    rows = json.loads(quick_run[2])["suites"]["loss"]["rows"]
    sched = loss_suite.schedule(quick=True)
    row = next(r for r in rows if (r["archetype"], r["variant"], r["num_seqs"]) == ("echo", "eager", 16))
    b = loss_suite.native_bin(loss_suite.bin_for("echo", sched.num_tokens, 16, "cpu"))
    with OpCounter() as counter:
        b.trainer_logprobs.grad = None
        loss_suite.native_step(b.plan, b.trainer_logprobs, b.denominators)[0].backward()
    assert (row["aten_ops"], row["syncs"]) == (counter.total, counter.num_syncs)


def test_bench_native_step_equals_the_reference():
    """The eager column computes the reference's loss and gradient (DPPO, the same member counts)."""
    from packloss.compat.prime_rl import DefaultLossConfig
    from packloss.testing import reference

    streams = loss_suite.bin_for("echo", 512, 16, "cpu")
    b = loss_suite.native_bin(streams)
    loss, _ = loss_suite.native_step(b.plan, b.trainer_logprobs, b.denominators)
    (grad,) = torch.autograd.grad(loss, streams.trainer_logprobs)
    rl_loss_fn = reference.setup_rl_loss_fn(DefaultLossConfig())
    loss_ref, _ = reference.compute_loss(**streams.lists(), rl_loss_fn=rl_loss_fn, **streams.integer_scales())
    (grad_ref,) = torch.autograd.grad(loss_ref, streams.trainer_logprobs)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("archetype", loss_suite.ARCHETYPES)
def test_bench_compat_floor_computes_what_compat_computes(archetype):
    """The floor row reads the lists unchecked but runs compat's own plan and engine: the same loss and
    gradient bit for bit, so compat ÷ floor is the cost of reading the lists and nothing else."""
    streams = loss_suite.bin_for(archetype, 512, 16, "cpu")
    results = []
    for make in (loss_suite._compat_step, loss_suite._compat_floor_step):
        make(streams)()
        results.append(streams.trainer_logprobs.grad.clone())
    assert torch.equal(results[0], results[1])
    assert results[0].abs().sum() > 0


def test_summary_is_reference_over_variant_at_the_densest_packing_and_flatness():
    rows = [
        {"archetype": "hot", "variant": "reference", "num_seqs": 1, "time_ms": 2.0},
        {"archetype": "hot", "variant": "reference", "num_seqs": 64, "time_ms": 40.0},
        {"archetype": "hot", "variant": "eager", "num_seqs": 1, "time_ms": 1.0},
        {"archetype": "hot", "variant": "eager", "num_seqs": 64, "time_ms": 1.25},
        {"archetype": "echo", "variant": "reference", "num_seqs": 1, "time_ms": 3.0},
        {"archetype": "echo", "variant": "reference", "num_seqs": 64, "time_ms": 30.0},
        {"archetype": "echo", "variant": "compat", "num_seqs": 64, "time_ms": 6.0},  # no S = 1 row: no figures
    ]
    assert loss_suite.summarise(rows) == {"hot": {"eager_speedup_at_64": 32.0, "eager_flatness_64_vs_1": 1.25}}


def test_quick_schedule_is_smaller_than_the_full_one():
    quick, full = loss_suite.schedule(quick=True), loss_suite.schedule(quick=False)
    assert max(quick.seq_counts) <= max(full.seq_counts) and quick.num_tokens <= full.num_tokens
    assert loss_suite.schedule(quick=True, use_compile=False).compiled_archetypes == ()
    streams = loss_suite.bin_for("echo", 64, 4, "cpu")
    assert (streams.num_tokens, streams.num_seqs) == (64, 4) and streams.ce_weights is not None
