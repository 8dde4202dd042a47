"""The RL rows of ``packloss bench peers``: a perturbed peer or naive formula fails the values check
before any timing, every packloss row is divided by every other row, and a peer that is not installed is
skipped with a note."""

from __future__ import annotations

import sys

import pytest
import torch

from packloss.tools.bench import naive_rl, peers_rl
from packloss.tools.bench._measure import ValuesDisagree


def _scaled(original):
    def scaled(*a):  # loss and gradient off by 1e-4
        loss, metrics = original(*a)
        return loss * (1 + 1e-4), metrics

    return scaled


def _shifted(original):
    def shifted(*a):  # the loss alone, by ~1e-4 of its value
        loss, metrics = original(*a)
        return loss + 1e-7, metrics

    return shifted


def _bent(original):
    def bent(*a):  # the loss alone right, the gradient at one token off by 1e-3
        *head, logp = a
        w = torch.ones_like(logp)
        w[0, 0] = 1.001
        return original(*head, logp + (logp * w - (logp * w).detach()) - (logp - logp.detach()))

    return bent


@pytest.mark.parametrize(("target", "perturb", "match"), [
    ("_trl_loss", _scaled, "float64"),
    ("_verl_loss", _scaled, "float64"),
    ("_trl_loss", _shifted, "float64. loss"),
    ("_verl_loss", _shifted, "float64. loss"),
    ("_trl_loss", _bent, "gradient"),
    ("_verl_loss", _bent, "gradient"),
])  # fmt: skip
def test_a_perturbed_rl_peer_fails_before_timing(monkeypatch, target, perturb, match):
    monkeypatch.setattr(peers_rl, target, perturb(getattr(peers_rl, target)))
    if target == "_verl_loss":
        monkeypatch.setitem(sys.modules, "trl", None)  # TRL's comparison (unperturbed, timed) comes first
    monkeypatch.setattr(peers_rl, "_interleaved_ms", lambda *a: pytest.fail("timed despite different values"))
    with pytest.raises(ValuesDisagree, match=match):
        peers_rl.run_rl([(96, 5)], False, 1, 1, lambda _d: None, [])


@pytest.mark.parametrize("formula", ["ppo_clip", "dual_clip", "dppo_tv"])
def test_a_naive_formula_with_a_wrong_metric_fails_the_check(monkeypatch, formula):
    original = getattr(naive_rl, formula)

    def off(*a, **k):
        loss, metrics = original(*a, **k)
        return loss, {name: value + 1e-3 for name, value in metrics.items()}

    monkeypatch.setattr(naive_rl, formula, off)
    monkeypatch.setattr(peers_rl, "_interleaved_ms", lambda steps, *a: dict.fromkeys(steps, 1.0))  # the other cases
    with pytest.raises(ValuesDisagree, match="naive_eager .* metric"):
        peers_rl.run_rl([(96, 5)], False, 1, 1, lambda _d: None, [])


def test_every_packloss_row_is_divided_by_every_peer_and_naive_row(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)
    monkeypatch.setattr(peers_rl, "_interleaved_ms", lambda steps, *a: {v: 1.0 + i for i, v in enumerate(steps)})
    rows = peers_rl.run_rl([(96, 5), (64, 4)], False, 1, 1, lambda _d: None, [])
    assert len({r["shape"] for r in rows}) == 2
    for row in rows:
        others = {
            r["variant"]: r["time_ms"]
            for r in rows
            if (r["comparison"], r["shape"]) == (row["comparison"], row["shape"])
        }
        if row["variant"] == "packloss_eager":
            assert set(others) == {"packloss_eager", "verl", "naive_eager"}
            assert row["vs_verl"] == row["time_ms"] / others["verl"]
            assert row["vs_naive_eager"] == row["time_ms"] / others["naive_eager"]
            assert row["metrics"] > 3  # packloss returns more metrics than verl logs (3)


def test_a_missing_rl_peer_is_skipped_with_a_note(monkeypatch):
    for module in ("trl", "verl.trainer.ppo.core_algos"):
        monkeypatch.setitem(sys.modules, module, None)  # importing it now raises ImportError
    notes: list[str] = []
    assert peers_rl.run_rl([(96, 5)], False, 1, 1, lambda _d: None, notes) == []
    assert any(n.startswith("rl/dapo·trl: trl not importable") for n in notes), notes
    assert any(n.startswith("rl/ppo_clip·verl, rl/dppo_tv·verl: verl") for n in notes), notes
