"""The RL rows of ``packloss bench peers``: a perturbed peer fails the values check before any timing,
and a peer that is not installed is skipped with a note."""

from __future__ import annotations

import sys

import pytest
import torch

from packloss.tools.bench import peers_rl
from packloss.tools.bench._measure import ValuesDisagree


def _scaled(original):
    return lambda *a: original(*a) * (1 + 1e-4)  # loss and gradient off by 1e-4


def _shifted(original):
    return lambda *a: original(*a) + 1e-7  # the loss alone, by ~1e-4 of its value


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
        peers_rl.run_rl(96, 5, False, 1, 1, lambda _d: None, [])


def test_a_missing_rl_peer_is_skipped_with_a_note(monkeypatch):
    for module in ("trl", "verl.trainer.ppo.core_algos"):
        monkeypatch.setitem(sys.modules, module, None)  # importing it now raises ImportError
    notes: list[str] = []
    assert peers_rl.run_rl(96, 5, False, 1, 1, lambda _d: None, notes) == []
    assert any(n.startswith("rl/dapo·trl: trl not importable") for n in notes), notes
    assert any(n.startswith("rl/ppo_clip·verl, rl/dppo_tv·verl: verl") for n in notes), notes
