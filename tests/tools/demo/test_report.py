"""packloss.tools.demo.report: the final tables, the acceptance figures, the log (``metrics.jsonl``), the
plain progress lines and the curves."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from packloss.tools import demo
from packloss.tools.demo import report

EVALS = {
    "teacher_sft": {"reward": 0.9, "exact": 0.5, "kl": None},
    "student_init": {"reward": 0.06, "exact": 0.0, "kl": 2.5},
    "student_distill": {"reward": 0.85, "exact": 0.25, "kl": 0.5},
    "student_rl": {"reward": 0.88, "exact": 0.3125, "kl": 0.45},
}
PHASES = {
    "sft": {"steps": 100, "tokens": 123456, "tokens_per_s": 2345.6, "wall_s": 52.64, "empty_bins": {"0": 0}},
    "rl": {"steps": 15, "tokens": 9876, "tokens_per_s": 88.2, "wall_s": 7.0, "empty_bins": {"0": 2, "1": 3}},
}


def test_format_table():
    assert demo.format_table({"evals": EVALS, "phases": PHASES}) == "\n".join(
        [
            "checkpoint       reward  exact  KL to teacher",
            "---------------  ------  -----  -------------",
            "teacher_sft       0.900  0.500",
            "student_init      0.060  0.000         2.5000",
            "student_distill   0.850  0.250         0.5000",
            "student_rl        0.880  0.312         0.4500",
            "",
            "phase  steps  tokens  tokens/s  wall s  empty bins",
            "-----  -----  ------  --------  ------  ----------",
            "sft      100  123456      2346    52.6           0",
            "rl        15    9876        88     7.0           5",
        ]
    )


def test_acceptance_figures():
    got = demo.acceptance(EVALS)
    assert got["distill_reward_fraction_of_teacher"] == pytest.approx(0.85 / 0.9)
    assert got["student_reward_gain"] == pytest.approx(0.88 - 0.06)
    assert got["rl_reward_change"] == pytest.approx(0.03)
    assert got["kl_reduction_factor"] == pytest.approx(5.0)
    assert got["distill_reaches_90pct_of_teacher"] is True  # 0.85 ≥ 0.81
    assert got["rl_does_not_lower_reward"] is True
    assert got["kl_falls_5x"] is True  # 2.5 ≥ 5 · 0.5
    worse = demo.acceptance({**EVALS, "student_rl": {"reward": 0.8, "exact": 0.2, "kl": 0.6}})
    assert worse["rl_does_not_lower_reward"] is False and worse["rl_reward_change"] == pytest.approx(-0.05)


def test_the_recorder_logs_on_the_lead_rank_only(tmp_path):
    lead = report.Recorder(tmp_path, "none", active=True)
    lead.log({"phase": "sft", "kind": "train", "step": 1, "loss": 0.5})
    lead.log({"phase": "sft", "kind": "eval", "step": 1, "reward": 0.1})
    lead.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["train", "eval"] and len(lead.records) == 2
    (tmp_path / "other").mkdir()
    other = report.Recorder(tmp_path / "other", "plain", active=False)
    other.log({"phase": "sft"})
    assert other.records == [] and not (tmp_path / "other" / "metrics.jsonl").exists()
    assert other.bar("sft", 10).kind == "none"  # the other ranks show no progress


def test_plain_progress_prints_five_lines_a_phase(capsys):
    bar = report.Progress("plain", "sft", 10)
    for step in range(10):
        bar.update({"loss": 1.0 / (step + 1)})
    bar.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "  sft 2/10 loss=0.5" and lines[-1] == "  sft 10/10 loss=0.1" and len(lines) == 5
    silent = report.Progress("none", "sft", 10)
    silent.update({"loss": 1.0})
    assert capsys.readouterr().out == ""
    assert report.progress_kind("tqdm") == "tqdm"
    assert report.progress_kind("auto") == "plain"  # stdout is no terminal under pytest


def test_curves_are_a_png(tmp_path):
    records = [{"phase": p, "kind": "train", "step": s, "loss": 1.0 / s, "reward": 0.1 * s, "kl": 1.0 / s}
               for p in ("sft", "rl") for s in (1, 2, 3)]  # fmt: skip
    records += [{"phase": p, "kind": "eval", "step": 3, "reward": 0.5, "kl": 0.2} for p in ("sft", "rl")]
    assert demo.plot_curves(records, tmp_path / "curves.png") is True
    with Image.open(tmp_path / "curves.png") as image:
        assert image.format == "PNG" and image.size[0] > 1000
