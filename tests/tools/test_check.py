"""``packloss check``: verdicts and exit codes on additive and non-additive custom losses
(tests/custom_losses.py), in process and through ``python -m packloss``; the comparison itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from packloss.tools import check
from packloss.tools.cli import main

TESTS = Path(__file__).parents[1]  # tests/, where custom_losses.py lives


@pytest.mark.parametrize(
    ("target", "kwargs", "expected"),
    [
        ("custom_losses:additive_loss", None, 0),
        ("custom_losses:additive_loss", '{"coef": 0.5}', 0),
        ("custom_losses:per_sequence_mean_naive", None, 1),
        ("custom_losses:per_sequence_mean_segmented", None, 0),
        ("custom_losses:no_such_function", None, 2),
        ("no_such_module_xyz:fn", None, 2),
        ("custom_losses:additive_loss", "[1, 2]", 2),
    ],
)
def test_check_exit_codes(target, kwargs, expected, capsys):
    argv = ["check", target] + ([] if kwargs is None else ["--kwargs", kwargs])
    assert main(argv) == expected
    out = capsys.readouterr().out
    if expected == 0:
        assert "PASS" in out
    if expected == 1:
        assert "FAIL" in out and "seq_ids" in out and "cu_seqlens" in out and "packloss.core.segments" in out


def test_python_m_packloss_check_imports_from_the_current_directory():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "packloss", "check", "custom_losses:per_sequence_mean_naive"],
        cwd=TESTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "FAIL" in proc.stdout and "num_seqs" in proc.stdout


def test_compare_on_bin_reports_the_differences():
    import custom_losses

    streams = check._bin("hot", 257, 9, 0)
    ok = check.compare_on_bin(custom_losses.additive_loss, {}, streams, "hot")
    assert ok.passed and ok.error is None and ok.grad_rel_diff <= check.RTOL
    bad = check.compare_on_bin(custom_losses.per_sequence_mean_naive, {}, check._bin("hot", 257, 9, 0), "hot")
    assert not bad.passed and bad.error is None and bad.loss_abs_diff > 0


def test_a_raising_loss_is_a_failed_bin_not_a_crash():
    def broken(inputs):
        raise RuntimeError("boom")

    (first, *_) = check.check_function(broken, {})
    assert not first.passed and "RuntimeError: boom" in first.error
    assert "FAIL" in check.report("x:broken", [first])
