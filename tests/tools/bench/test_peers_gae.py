"""The advantage rows of ``packloss bench peers``: packed GAE and verl's own loop are checked equal
before timing (a perturbed one fails), each packloss row is divided by verl's, and a missing verl is
skipped with a note."""

from __future__ import annotations

import sys

import pytest

from packloss.tools.bench import peers_gae
from packloss.tools.bench._measure import ValuesDisagree


def test_rows_and_ratio(monkeypatch):
    monkeypatch.setattr(peers_gae, "_interleaved_ms", lambda steps, *a: {"packloss": 1.0, "verl": 4.0})
    rows = peers_gae.run_gae([(96, 5), (64, 4)], 1, 1, lambda _d: None, [])
    assert [r["variant"] for r in rows] == ["packloss", "verl"] * 2
    assert [r["shape"].split()[0] for r in rows] == ["N=96", "N=96", "N=64", "N=64"]
    assert all(r["vs_verl"] == 0.25 for r in rows if r["variant"] == "packloss")


@pytest.mark.parametrize("which", ["returns", "advantages"])
def test_a_perturbed_gae_fails_before_timing(monkeypatch, which):
    original = peers_gae.gae_advantages

    def off(*a, **k):
        adv, ret = original(*a, **k)
        return (adv * 1.001, ret) if which == "advantages" else (adv, ret + 1e-6)

    monkeypatch.setattr(peers_gae, "gae_advantages", off)
    monkeypatch.setattr(peers_gae, "_interleaved_ms", lambda *a: pytest.fail("timed despite different values"))
    with pytest.raises(ValuesDisagree, match=f"gae·verl {which}"):
        peers_gae.run_gae([(96, 5)], 1, 1, lambda _d: None, [])


def test_a_missing_verl_is_skipped_with_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "verl.trainer.ppo.core_algos", None)
    notes: list[str] = []
    assert peers_gae.run_gae([(96, 5)], 1, 1, lambda _d: None, notes) == []
    assert notes and notes[0].startswith("gae·verl: verl.trainer.ppo.core_algos not importable")
