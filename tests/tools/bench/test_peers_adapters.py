"""The adapter rows of ``packloss bench peers`` at a tiny shape: one checked row per variant of each
comparison (TRL, verl and OpenRLHF are installed in the test environment), every packloss row divided by
the peer's; an adapter whose loss or metric differs from the peer's fails before any timing; a missing
peer is skipped with a note. No timing is asserted."""

from __future__ import annotations

import sys

import pytest
import torch

from packloss.integrations.openrlhf import PolicyLoss
from packloss.tools.bench import peers_adapters
from packloss.tools.bench._measure import ValuesDisagree
from packloss.tools.bench.peers_rl import RL_RTOL, rl_batch

SHAPE = (96, 5)
VARIANTS = {
    "adapter/trl_trainer": {"packloss_eager", "trl"},
    "adapter/verl_plugin": {"packloss_eager", "verl"},
    "adapter/openrlhf_policy_loss": {"packloss_eager", "packloss_rows_eager", "openrlhf"},
}
PEER_METRICS = {"adapter/trl_trainer": 6, "adapter/verl_plugin": 3, "adapter/openrlhf_policy_loss": 2}


def _run(notes: list[str] | None = None) -> list[dict]:
    return peers_adapters.run_adapters([SHAPE], False, 1, 2, lambda _d: None, [] if notes is None else notes)


@pytest.fixture(scope="module")
def rows():
    return _run()


def test_one_checked_row_per_variant_with_its_ratio_to_the_peer(rows):
    assert tuple(dict.fromkeys(r["comparison"] for r in rows)) == peers_adapters.COMPARISONS
    for comparison, variants in VARIANTS.items():
        mine = {r["variant"]: r for r in rows if r["comparison"] == comparison}
        assert set(mine) == variants
        peer = next(v for v in variants if not v.startswith("packloss"))
        assert mine[peer]["metrics"] == PEER_METRICS[comparison]
        for variant in variants - {peer}:
            row = mine[variant]
            assert 0 <= row["grad_rel_err"] <= RL_RTOL and row["loss_rel_diff"] >= 0
            assert row[f"vs_{peer}"] == row["time_ms"] / mine[peer]["time_ms"]
            assert row["metrics"] >= PEER_METRICS[comparison]  # the peer's metrics and packloss's own


def test_compiled_variants_only_where_the_peer_call_compiles():
    cases = {case.name: case for case in peers_adapters._cases(rl_batch(*SHAPE), [])}
    compiled = {name: set(peers_adapters._variants(case, compiled=True)) for name, case in cases.items()}
    assert compiled["adapter/trl_trainer"] == VARIANTS["adapter/trl_trainer"]
    assert {"packloss_compiled", "verl_compiled"} <= compiled["adapter/verl_plugin"]
    assert {"packloss_compiled", "packloss_rows_compiled", "openrlhf_compiled"} <= compiled[
        "adapter/openrlhf_policy_loss"
    ]


def _perturbed(monkeypatch, change):
    """packloss's OpenRLHF ``PolicyLoss`` with its outputs passed through ``change``; no timing allowed."""
    forward = PolicyLoss.forward
    monkeypatch.setattr(PolicyLoss, "forward", lambda self, *a, **k: change(forward(self, *a, **k)))
    for module in ("trl", "verl.trainer.ppo.core_algos"):  # their comparisons come first, unperturbed
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setattr(peers_adapters, "_interleaved_ms", lambda *a: pytest.fail("timed despite different values"))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda out: (out[0] * (1 + 1e-6), *out[1:]), r"float64\) gradient"),
        (lambda out: (out[0] + 1e-9, *out[1:]), r"float64\) loss"),
        (lambda out: (out[0], out[1] + 1e-3, *out[2:]), "metric clip_ratio"),
    ],
)
def test_an_adapter_that_differs_from_its_peer_fails_before_timing(monkeypatch, change, match):
    _perturbed(monkeypatch, change)
    with pytest.raises(ValuesDisagree, match=match):
        _run()


def test_a_metric_the_peer_returns_must_be_returned():
    with pytest.raises(ValuesDisagree, match="'ppo_kl' the peer returns is missing"):
        peers_adapters._check_metrics("x", {"clip_ratio": torch.zeros(())}, {"clip_ratio": 0.0, "ppo_kl": 0.1}, 0, 0)


def test_a_missing_peer_is_skipped_with_a_note(monkeypatch):
    for module in ("trl", "verl.trainer.ppo.core_algos"):
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setattr(peers_adapters, "load_openrlhf_loss", lambda: None)
    notes: list[str] = []
    assert _run(notes) == []
    assert [n.split(":")[0] for n in notes] == list(peers_adapters.COMPARISONS)
