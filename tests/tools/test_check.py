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


USER_LOSSES = """
import sys

import torch

from packloss.compat.prime_rl import LossOutputs


def _additive(inputs):
    m = inputs.loss_mask
    return LossOutputs(loss=torch.where(m, -inputs.trainer_logprobs * inputs.advantages, 0.0).sum(), metrics={})


def no_arguments():
    return None


def fails_when_packed(inputs):
    if inputs.num_seqs > 1:
        raise ValueError("packed")
    return _additive(inputs)


def fails_per_sequence(inputs):
    if inputs.num_seqs == 1:
        raise ValueError("one sequence")
    return _additive(inputs)


def exits(inputs):
    sys.exit(0)


def raises_system_exit(inputs):
    raise SystemExit("bye")
"""


@pytest.fixture
def user_losses(tmp_path, monkeypatch) -> str:
    """A user's module of losses (and one that exits at import), importable for ``packloss check``."""
    (tmp_path / "packloss_user_losses.py").write_text(USER_LOSSES)
    (tmp_path / "packloss_exits_on_import.py").write_text("import sys\n\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("packloss_user_losses", "packloss_exits_on_import"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return "packloss_user_losses"


def _one_error_line(capsys, target: str) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and "\n" not in err and "Traceback" not in err, captured
    assert err.startswith("packloss check: error:") and target in err
    return err


@pytest.mark.parametrize(
    ("function", "kwargs", "reason"),
    [("no_arguments", None, "TypeError"), ("fails_when_packed", '{"bogus": 1}', "TypeError")],
)
def test_check_a_loss_raising_on_every_bin_cannot_be_checked(user_losses, function, kwargs, reason, capsys):
    target = f"{user_losses}:{function}"
    assert main(["check", target] + ([] if kwargs is None else ["--kwargs", kwargs])) == 2
    assert reason in _one_error_line(capsys, target)


@pytest.mark.parametrize("function", ["fails_when_packed", "fails_per_sequence"])
def test_check_a_loss_raising_in_one_calling_convention_is_a_fail(user_losses, function, capsys):
    assert main(["check", f"{user_losses}:{function}"]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize(("function", "reason"), [("exits", "sys.exit(0)"), ("raises_system_exit", "sys.exit('bye')")])
def test_check_a_loss_calling_sys_exit_cannot_be_checked(user_losses, function, reason, capsys):
    target = f"{user_losses}:{function}"
    assert main(["check", target]) == 2
    assert reason in _one_error_line(capsys, target)


def test_check_a_module_exiting_at_import_cannot_be_checked(user_losses, capsys):
    target = "packloss_exits_on_import:fn"
    assert main(["check", target]) == 2
    assert "SystemExit" in _one_error_line(capsys, target)


def test_check_does_not_swallow_keyboard_interrupt():
    def interrupted(inputs):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        check.check_function(interrupted, {})
