"""packloss.tools.cli: the ``packloss`` command: ``bench loss --quick`` exits 0 and writes its outputs
(their content: tests/tools/bench/), the ``bench all`` error path, usage errors refused up front, and every
subcommand's ``--help`` (``check``: tests/tools/test_check.py)."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from PIL import Image

from packloss.tools.bench import loss as loss_suite
from packloss.tools.cli import main


def test_bench_quick_exits_zero_and_writes_outputs(quick_run):
    code, out, _ = quick_run
    assert code == 0
    assert (out / "results.json").is_file()
    assert (out / "loss_time.png").is_file()


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
