"""The ``packloss`` command: ``bench loss --quick`` output (table, JSON schema, plots, op counts), the
``bench all`` error path, and every subcommand's ``--help`` (``check``: tests/tools/test_check.py)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from PIL import Image

from packloss.testing import OpCounter
from packloss.tools.bench import loss as loss_suite
from packloss.tools.cli import main

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


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[int, Path, str]:
    """One in-process ``packloss bench loss --quick`` (the compiled column on the hot path included)."""
    out = tmp_path_factory.mktemp("bench")
    threads = torch.get_num_threads()
    try:
        code = main(["bench", "loss", "--quick", "--out", str(out), "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    return code, out, (out / "results.json").read_text()


def test_bench_quick_exits_zero_and_writes_outputs(quick_run):
    code, out, _ = quick_run
    assert code == 0
    assert (out / "results.json").is_file()
    assert (out / "loss_time.png").is_file()


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
        loss_suite.native_step(b.plan, b.trainer_logprobs, b.denominators).backward()
    assert (row["aten_ops"], row["syncs"]) == (counter.total, counter.num_syncs)


def test_bench_native_step_equals_the_reference():
    """The eager column computes the reference's loss and gradient (DPPO, the same member counts)."""
    from packloss.compat.prime_rl import DefaultLossConfig
    from packloss.testing import reference

    streams = loss_suite.bin_for("echo", 512, 16, "cpu")
    b = loss_suite.native_bin(streams)
    loss = loss_suite.native_step(b.plan, b.trainer_logprobs, b.denominators)
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


def test_bench_plots_are_valid_pngs(quick_run):
    path = quick_run[1] / "loss_time.png"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


def _fake_distill_run(device: str, quick: bool, progress=None) -> dict:
    rows = [
        {"shape": "64x128", "variant": v, "time_ms": 1.0, "peak_bytes": b}
        for v, b in (("naive_eager", 3 << 20), ("packloss_eager", 1 << 20))
    ]
    return {"rows": rows}


def test_bench_all_reports_a_missing_suite_and_plots_memory(monkeypatch, tmp_path):
    distill = types.ModuleType("packloss.tools.bench.distill")
    distill.run = _fake_distill_run
    monkeypatch.setitem(sys.modules, "packloss.tools.bench.distill", distill)
    monkeypatch.setitem(sys.modules, "packloss.tools.bench.head", None)  # importing head now raises
    monkeypatch.setattr(loss_suite, "run", lambda device, quick, progress, use_compile: {"rows": []})
    code = main(["bench", "all", "--quick", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "results.json").read_text())
    assert code == 1
    assert "error" in payload["suites"]["head"] and payload["suites"]["head"]["rows"] == []
    assert "error" not in payload["suites"]["loss"] and "error" not in payload["suites"]["distill"]
    with Image.open(tmp_path / "distill_memory.png") as image:
        image.verify()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_cuda_without_a_gpu_is_a_usage_error(tmp_path, capsys):
    assert main(["bench", "loss", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_help_of_every_subcommand(capsys):
    for argv in (["--help"], ["bench", "--help"], ["check", "--help"], ["demo", "--help"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "MODULE:FUNCTION" in out and "--nproc" in out


@pytest.fixture
def no_suites(monkeypatch):
    """Running any bench suite fails the test: usage errors must be refused up front."""

    def refuse(*args, **kwargs):
        raise AssertionError("a suite ran despite a usage error")

    monkeypatch.setattr("packloss.tools.cli.run_suite", refuse)


def _usage_line(capsys, command: str, option: str) -> str:
    """The last stderr line (argparse prints the usage above it): ``packloss COMMAND: error: ...``
    naming ``option``; no traceback."""
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and line.startswith(f"packloss {command}: error:") and option in line, err
    return line


def _exit_code(argv: list[str]) -> int:
    """``main``'s exit code, whether returned or raised by argparse."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("under_file", [False, True])
def test_bench_unwritable_out_is_a_usage_error(no_suites, tmp_path, capsys, under_file):
    regular = tmp_path / "file"
    regular.write_text("")
    out = regular / "sub" if under_file else regular
    assert main(["bench", "loss", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("packloss bench: error: --out") and str(out) in err, err


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_bench_threads_must_be_positive(no_suites, tmp_path, capsys, value):
    assert _exit_code(["bench", "loss", "--threads", value, "--out", str(tmp_path)]) == 2
    _usage_line(capsys, "bench", "--threads")


@pytest.mark.parametrize("device", ["tpu", "cuda:", "cuda:x", "CPU", "cpu:0"])
def test_bench_unknown_device_is_refused_up_front(no_suites, tmp_path, capsys, device):
    assert _exit_code(["bench", "loss", "--device", device, "--out", str(tmp_path)]) == 2
    _usage_line(capsys, "bench", "--device")
    assert not (tmp_path / "results.json").exists()


def test_device_names_accepted():
    from packloss.tools.cli import build_parser

    for device in ("cpu", "cuda", "cuda:0", "cuda:12"):
        assert build_parser().parse_args(["bench", "--device", device]).device == device


DEMO_COUNTS = ("--sft-steps", "--distill-steps", "--rl-steps", "--nproc", "--threads", "--emulate-ranks")


@pytest.mark.parametrize("value", ["0", "-3"])
@pytest.mark.parametrize("option", DEMO_COUNTS)
def test_demo_counts_must_be_positive(capsys, option, value):
    assert _exit_code(["demo", "--quick", option, value]) == 2
    _usage_line(capsys, "demo", option)


@pytest.mark.parametrize("under_file", [False, True])
def test_demo_unwritable_out_is_a_usage_error(monkeypatch, tmp_path, capsys, under_file):
    def refuse(*args, **kwargs):
        raise AssertionError("the demo ran despite a usage error")

    monkeypatch.setattr("packloss.tools.demo.cli._worker", refuse)
    regular = tmp_path / "file"
    regular.write_text("")
    out = regular / "sub" if under_file else regular
    assert main(["demo", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("packloss demo: error: --out") and str(out) in err, err
