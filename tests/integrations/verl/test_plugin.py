"""packloss's verl plugin (``packloss.integrations.verl.plugin``) against verl 0.9.1's own policy losses.

verl's side and the plugin's side both run through verl's ``ppo_loss`` (the engine's loss), once per
micro-batch with the engine's ``dp_size`` / ``batch_num_tokens`` / ``global_batch_size``, on the same
float64 batch and the same leaf of trainer log-probs; only ``policy_loss.loss_mode`` differs
(``<mode>`` vs ``packloss_<mode>``). The batch and verl's calling convention come from
``test_verl.py``. Registration itself is checked in fresh interpreters, where the user imports verl only.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import verl  # noqa: F401 - loads the verl.plugins entry points, packloss's among them
from verl.protocol import DataProto
from verl.trainer.config import RolloutCorrectionConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

from conftest import ROOT
from packloss import PolicyGradient
from packloss.integrations.verl import LOSS_AGG_MODES, from_verl
from packloss.integrations.verl import plugin as verl_plugin
from packloss.integrations.verl.plugin import PREFIX, REGISTERED, register, register_objective
from packloss.testing import OpCounter
from tests.integrations.verl.harness import (
    COV,
    F64,
    Batch,
    actor_config,
    assert_close,
    first_epoch,
    leaves,
    make_batch,
    packloss_step,
    verl_micro,
    verl_step,
)

MODES = ["vanilla", "gspo", "cispo", "gpg", "sapo", "geo_mean", "dppo_tv", "dppo_kl", "dro"]
WHOLE = [[list(range(12))]]
TWO_RANKS = [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10, 11]]]
THREE_MICRO = [[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]]


def plugin(cfg):
    """The same actor config with ``policy_loss.loss_mode = packloss_<mode>``."""
    mode = cfg.policy_loss.loss_mode
    return dataclasses.replace(cfg, policy_loss=dataclasses.replace(cfg.policy_loss, loss_mode=PREFIX + mode))


def step_and_grad(cfg, b: Batch, split, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    lp, ent = leaves(b)
    loss = verl_step(cfg, b, split, lp, ent, **kw)
    return loss.detach(), torch.autograd.grad(loss, lp)[0]


def compare_with_native(cfg, b: Batch, split, **kw) -> None:
    """verl's step with its own loss mode vs with packloss's: loss and gradient within 1e-10."""
    v, gv = step_and_grad(cfg, b, split, **kw)
    p, gp = step_and_grad(plugin(cfg), b, split, **kw)
    assert_close(p, v, "loss")
    assert_close(gp, gv, "d loss / d log_prob")


def padded(b: Batch, packed: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """A packed stream ``[N]`` as the batch's padded ``[B, T]`` (``fill`` at the padding)."""
    return torch.full(b.mask.shape, fill, dtype=packed.dtype).masked_scatter(b.valid, packed)


# ---------------------------------------------------------------------------------------------------
# Registration on `import verl`, in fresh interpreters
# ---------------------------------------------------------------------------------------------------


def run_python(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter outside the checkout (packloss comes from the installed package)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    environ.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def docs_snippet() -> str:
    text = (ROOT / "docs" / "integrations" / "verl.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "docs/integrations/verl.md has no python snippet"
    return blocks[0]


def test_import_verl_registers_every_loss_and_the_docs_snippet_runs(tmp_path):
    """After only ``import verl`` (the snippet imports nothing of packloss) ``get_policy_loss_fn`` finds
    every ``packloss_*`` loss, and the snippet's packloss_vanilla equals verl's vanilla."""
    snippet = docs_snippet()
    assert not re.search(r"^\s*(import|from)\s+packloss", snippet, flags=re.M), "the snippet must not import packloss"
    probe = (
        "\nfrom verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY\n"
        "print('REGISTERED', sorted(k for k in POLICY_LOSS_REGISTRY if k.startswith('packloss_')))\n"
        "print('MODULE', get_policy_loss_fn('packloss_gspo').__module__)\n"
    )
    out = run_python(snippet + probe, tmp_path).stdout
    assert "packloss_vanilla" in out and "= vanilla" in out
    registered = re.search(r"REGISTERED (\[.*\])", out).group(1)
    assert set(REGISTERED) == set(ast.literal_eval(registered))
    assert "MODULE packloss.integrations.verl.plugin" in out


def test_plugins_off_registers_nothing(tmp_path):
    """The entry point is what registers: with verl's plugins off, packloss is not even imported."""
    code = (
        "import sys, verl\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY\n"
        "print(any(k.startswith('packloss_') for k in POLICY_LOSS_REGISTRY), 'packloss' in sys.modules)\n"
    )
    assert run_python(code, tmp_path, VERL_USE_EXTERNAL_PLUGINS="none").stdout.split() == ["False", "False"]
    assert run_python(code, tmp_path, VERL_USE_EXTERNAL_PLUGINS="packloss").stdout.split() == ["True", "True"]


def test_a_failed_registration_warns_and_import_verl_succeeds(tmp_path):
    """If registering fails (here: verl's core_algos cannot be imported), ``import verl`` still works and
    packloss logs a warning."""
    code = (
        "import sys\n"
        "sys.modules['verl.trainer.ppo.core_algos'] = None\n"  # any import of it now raises
        "import verl\n"
        "print('imported', verl.__version__)\n"
    )
    proc = run_python(code, tmp_path)
    assert "imported 0.9.1" in proc.stdout
    assert "packloss: could not register its policy losses with verl (" in proc.stderr


def test_register_is_idempotent_and_leaves_foreign_losses_alone(caplog):
    registry = core_algos.POLICY_LOSS_REGISTRY
    ours = {name: registry[name] for name in REGISTERED}
    assert all(fn.__name__ == name for name, fn in ours.items())
    assert set(REGISTERED) <= set(register()) and set(REGISTERED) <= set(register())
    assert all(registry[name] is fn for name, fn in ours.items())

    def foreign(*args, **kwargs):
        raise AssertionError("not called")

    registry["packloss_gpg"] = foreign
    try:
        with caplog.at_level(logging.WARNING, logger=verl_plugin.__name__):
            names = register()
        assert "packloss_gpg" not in names and registry["packloss_gpg"] is foreign
        assert "already registered" in caplog.text
        assert "packloss_gpg" in register(overwrite=True) and registry["packloss_gpg"] is ours["packloss_gpg"]
    finally:
        registry["packloss_gpg"] = ours["packloss_gpg"]


# ---------------------------------------------------------------------------------------------------
# Equal to verl's own loss modes, through verl's ppo_loss
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [WHOLE, TWO_RANKS], ids=["one-call", "2ranks-x-2micro"])
@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("mode", MODES)
def test_equals_verl_native_mode(mode, agg, split):
    """Every mapped mode × every loss_agg_mode: one call, and a step of 2 ranks × 2 micro-batches with the
    engine's global_batch_info (rows without members included, seq-mean-token-sum-norm with the padded
    width): packloss_<mode> is verl's <mode>, loss and gradient, within 1e-10."""
    b = make_batch(200 + MODES.index(mode), rows=12, empty=(2, 7))
    cfg = actor_config(mode, agg, kl=None, entropy=0.0, rows=12)
    compare_with_native(cfg, b, split)


@pytest.mark.parametrize("mode", ["vanilla", "sapo", "geo_mean"])
def test_inside_ppo_loss_with_kl_entropy_and_three_micro_batches(mode):
    """The policy term inside the whole of verl's loss (KL and entropy added by ppo_loss), three
    micro-batches of one rank; entropy's gradient unchanged."""
    b = make_batch(210, rows=12, empty=(5,))
    cfg = actor_config(mode, "seq-mean-token-sum", kl="low_var_kl", entropy=0.01, rows=12)
    compare_with_native(cfg, b, THREE_MICRO)
    lp, ent = leaves(b)
    g_native = torch.autograd.grad(verl_step(cfg, b, THREE_MICRO, lp, ent), ent)[0]
    g_plugin = torch.autograd.grad(verl_step(plugin(cfg), b, THREE_MICRO, lp, ent), ent)[0]
    assert_close(g_plugin, g_native, "d loss / d entropy")


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("mode", ["vanilla", "gspo", "geo_mean"])
def test_without_global_batch_info_uses_the_micro_batch(mode, agg):
    """A call outside the engine (no batch_num_tokens / global_batch_size): the micro-batch's own counts,
    as verl's agg_loss falls back to."""
    b = make_batch(220, rows=8, empty=(3,))
    cfg = actor_config(mode, agg, kl=None, entropy=0.0)
    kw = dict(dp_size=1, num_tokens=None, global_batch_size=None)
    lp, ent = leaves(b)
    v = verl_micro(cfg, b, list(range(8)), lp, ent, **kw)
    p = verl_micro(plugin(cfg), b, list(range(8)), lp, ent, **kw)
    assert_close(p.detach(), v.detach(), "loss")
    assert_close(torch.autograd.grad(p, lp)[0], torch.autograd.grad(v, lp)[0], "gradient")


def test_loss_scale_factor_and_padded_width():
    """seq-mean-token-sum-norm: a given loss_scale_factor, and None (verl's padded width, here wider than
    the longest response)."""
    b = make_batch(230, rows=8)
    for scale, width in ((7, None), (None, b.width + 5)):
        cfg = actor_config("vanilla", "seq-mean-token-sum-norm", kl=None, entropy=0.0, scale=scale)
        lp, ent = leaves(b)
        kw = dict(dp_size=2, num_tokens=int(b.mask.sum()), global_batch_size=8, width=width)
        v = verl_micro(cfg, b, list(range(8)), lp, ent, **kw)
        p = verl_micro(plugin(cfg), b, list(range(8)), lp, ent, **kw)
        assert_close(p.detach(), v.detach(), f"loss (loss_scale_factor={scale})")


@pytest.mark.parametrize("split", [[[list(range(8))]], [[[0, 1, 2, 3], [4, 5, 6, 7]]]], ids=["one-call", "2micro"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("mode", ["clip_cov", "kl_cov"])
def test_covariance_modes_equal_verl_on_the_first_epoch(mode, agg, split):
    """Clip-Cov / KL-Cov select over each micro-batch, as verl; from the old log-probs, which on the first
    epoch are verl's live ones (clip_cov: k covers the band, so verl's random draw takes all of it)."""
    b = first_epoch(make_batch(240 + len(split[0]), rows=8, empty=(2,)), 3)
    cfg = actor_config(mode, agg, kl=None, entropy=0.0)
    cfg = dataclasses.replace(cfg, policy_loss=dataclasses.replace(cfg.policy_loss, **COV[mode]))
    compare_with_native(cfg, b, split)


# ---------------------------------------------------------------------------------------------------
# Rollout correction
# ---------------------------------------------------------------------------------------------------


def decoupled_weights(b: Batch, level: str, threshold, rs=None, rs_threshold=None) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's trainer-side correction: ``(rollout_is_weights [B, T], response_mask after rejection)``."""
    rc = RolloutCorrectionConfig(
        rollout_is=level, rollout_is_threshold=threshold, rollout_rs=rs, rollout_rs_threshold=rs_threshold
    )
    batch = DataProto.from_dict(
        tensors={"old_log_probs": b.old, "rollout_log_probs": b.rollout, "response_mask": b.mask.long()}
    )
    batch, _ = compute_rollout_correction_and_add_to_batch(batch, rc)
    return batch.batch["rollout_is_weights"], batch.batch["response_mask"].bool()


@pytest.mark.parametrize("level, threshold", [("token", 2.0), ("token", "0.8_1.1"), ("sequence", "0.5_5.0")])
@pytest.mark.parametrize(
    "mode, agg",
    [
        ("vanilla", "token-mean"),
        ("gspo", "seq-mean-token-mean"),
        ("cispo", "seq-mean-token-sum"),
        ("geo_mean", "token-mean"),
        ("dro", "token-sum"),
        ("sapo", "token-mean"),
    ],
)
def test_rollout_is_weights_as_verl_applies_them(mode, agg, level, threshold):
    """The trainer's importance weights (truncated, and masked: zero weights outside the band) multiply
    the per-token policy loss and leave the members alone (a zero weight stays in ``n_s`` and in GSPO's
    sequence mean); geo_mean takes verl's per-row geometric mean of them."""
    b = make_batch(250, rows=12, empty=(4,))
    w, _ = decoupled_weights(b, level, threshold)
    members = b.mask & (w == 0)
    if level == "token" and isinstance(threshold, str):
        assert bool(members.any()), "the masked band should zero some members' weights"
    cfg = actor_config(mode, agg, kl=None, entropy=0.0, rows=12)
    compare_with_native(cfg, b, TWO_RANKS, weights=w)


def test_rejection_mask_and_weights_together():
    b = make_batch(251, rows=12, empty=(4,))
    w, mask = decoupled_weights(b, "token", 2.0, "seq_sum_k1", "0.6_1.6")
    assert 0 < int(mask.sum()) < int(b.mask.sum())
    cfg = actor_config("vanilla", "seq-mean-token-mean", kl=None, entropy=0.0, rows=12)
    compare_with_native(cfg, b, TWO_RANKS, weights=w, mask=mask)


@pytest.mark.parametrize(
    "loss_type, rc",
    [
        ("ppo_clip", {}),
        ("ppo_clip", {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.6_2.5"}),
        ("reinforce", {"rollout_is": "token", "rollout_is_threshold": 2.0}),
        ("reinforce", {"rollout_is": "sequence", "rollout_is_threshold": "0.5_5.0"}),
        ("reinforce", {"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.3_4.0"}),
    ],
)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_bypass_mode_equals_verl(loss_type, rc, agg):
    """packloss_bypass_mode reads policy_loss.rollout_correction as verl's bypass_mode: old_log_prob is
    the rollout's, weights and rejection from the live log_prob; the trainer's weights are ignored."""
    rc = RolloutCorrectionConfig(bypass_mode=True, loss_type=loss_type, **({"rollout_is": None} | rc))
    cfg = actor_config(f"bypass:{loss_type}", agg, kl=None, entropy=0.0, rollout=rc, rows=12)
    b = make_batch(260, rows=12, empty=(4,))
    ignored = torch.rand(b.mask.shape, dtype=F64) + 0.5
    compare_with_native(cfg, b, TWO_RANKS, old=b.rollout, weights=ignored)


# ---------------------------------------------------------------------------------------------------
# The padded path vs packloss's packed fast path
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("mode", ["vanilla", "gspo", "sapo", "dppo_kl", "geo_mean"])
def test_padded_path_equals_compute_loss_on_the_packed_step(mode, agg):
    """The plugin on verl's padded micro-batches (through ppo_loss, 2 ranks × 2 micro-batches) vs
    ``compute_loss`` on the responses packed back to back, with ``count_denominators`` over the step and
    ``from_verl``'s recipe: the same loss and gradient (no rows without members, so verl's G is packloss's
    sequence count; geo_mean, whose verl rule is per call, on one call)."""
    b = make_batch(270 + MODES.index(mode), rows=12, empty=())
    cfg = actor_config(mode, agg, kl=None, entropy=0.0, rows=12)
    split = WHOLE if mode == "geo_mean" else TWO_RANKS
    lp, ent = leaves(b)
    p = verl_step(plugin(cfg), b, split, lp, ent)
    fast = packloss_step(from_verl(cfg, response_length=b.width), b, split, lp, ent)
    assert_close(p.detach(), fast.detach(), "loss")
    assert_close(torch.autograd.grad(p, lp)[0], torch.autograd.grad(fast, lp)[0], "gradient")


# ---------------------------------------------------------------------------------------------------
# packloss-only objectives, against the paper's formula per row
# ---------------------------------------------------------------------------------------------------


def reference_rows(b: Batch, per_token) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``per_token(row, logp, old, adv) -> ℓ [n]`` on each row's members (plain autograd, one row at a time)."""
    lp, _ = leaves(b)
    off = b.offsets()
    rows = []
    for i in range(b.num_rows):
        m = b.mask[i, : b.resp_lens[i]]
        logp = lp[off[i] : off[i + 1]][m]
        rows.append(per_token(logp, b.old[i, : b.resp_lens[i]][m], b.adv[i, : b.resp_lens[i]][m]))
    return lp, rows


def topr_reference(logp, old, adv):
    """TOPR (Le Roux et al. 2025, eq. 7): ``−A log π`` on A ≥ 0, ``−sg([π/μ]_0^1) A log π`` on A < 0, with
    the sequence's ratio ``π(y)/μ(y) = exp(Σ_t log π − log μ)``."""
    w = torch.exp((logp - old).sum()).clamp(0.0, 1.0).detach()
    return -torch.where(adv >= 0, torch.ones_like(adv), w) * adv * logp


def dppo_reference(low, high):
    """prime-rl's DPPO: ``−keep · r · A + 1e-3 (log π − old)²``, keep = ``π − π_old ≤ high`` (A > 0),
    ``π − π_old ≥ −low`` (A ≤ 0)."""

    def per_token(logp, old, adv):
        dp = logp.detach().exp() - old.exp()
        keep = torch.where(adv > 0, dp <= high, dp >= -low)
        return -keep.to(logp.dtype) * torch.exp(logp - old) * adv + 1e-3 * (logp - old) ** 2

    return per_token


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("mode", ["topr", "dppo"])
def test_packloss_only_objectives_match_the_paper(mode, agg):
    """packloss_topr / packloss_dppo through verl's ppo_loss over 2 ranks × 2 micro-batches vs the
    formula written out per row, with verl's normalisation of the step."""
    b = make_batch(280, rows=12, empty=(4,))
    b.adv[1] = -b.adv[1].abs()  # a negative row with its sequence ratio below 1 and one above
    b.old[1] = b.old[1] + 0.02
    b.adv[3] = -b.adv[3].abs()
    b.old[3] = b.old[3] - 0.05
    cfg = plugin(actor_config(mode, agg, kl=None, entropy=0.0, rows=12, clip_ratio_low=0.1, clip_ratio_high=0.15))
    per_token = topr_reference if mode == "topr" else dppo_reference(0.1, 0.15)
    lp, rows = reference_rows(b, per_token)
    if agg == "token-mean":
        expected = sum(r.sum() for r in rows) / int(b.mask.sum())
    else:
        expected = sum(r.sum() / len(r) for r in rows if len(r)) / b.num_rows
    ent = b.entropy.clone()
    got = verl_step(cfg, b, TWO_RANKS, lp, ent)
    assert_close(got.detach(), expected.detach(), "loss")
    assert_close(torch.autograd.grad(got, lp)[0], torch.autograd.grad(expected, lp)[0], "gradient")


def test_register_objective_adds_a_loss_mode():
    name = register_objective("plain_reinforce", lambda cfg: PolicyGradient("gpg"), overwrite=True)
    assert name == "packloss_plain_reinforce" and get_policy_loss_fn(name).__name__ == name
    b = make_batch(290, rows=12, empty=(4,))
    cfg = actor_config("gpg", "seq-mean-token-sum", kl=None, entropy=0.0, rows=12)
    v, gv = step_and_grad(cfg, b, TWO_RANKS)
    custom = dataclasses.replace(cfg, policy_loss=dataclasses.replace(cfg.policy_loss, loss_mode=name))
    p, gp = step_and_grad(custom, b, TWO_RANKS)
    assert_close(p, v, "loss")
    assert_close(gp, gv, "gradient")
    with pytest.raises(ValueError, match="already a packloss policy loss"):
        register_objective("vanilla", lambda cfg: PolicyGradient("gpg"))
    with pytest.raises(ValueError, match="identifier"):
        register_objective("not a name", lambda cfg: PolicyGradient("gpg"))
    register_objective("not_an_objective", lambda cfg: "gpg", overwrite=True)
    with pytest.raises(TypeError, match="must return a PolicyGradient"):
        step_and_grad(
            dataclasses.replace(
                cfg, policy_loss=dataclasses.replace(cfg.policy_loss, loss_mode="packloss_not_an_objective")
            ),
            b,
            WHOLE,
        )


# ---------------------------------------------------------------------------------------------------
# Metrics, syncs, op counts, NaN safety, errors
# ---------------------------------------------------------------------------------------------------


def direct_call(name: str, cfg, b: Batch, lp: torch.Tensor, weights=None, **info):
    """The policy-loss function called as ppo_loss calls it, on the padded batch."""
    cfg.global_batch_info.clear()
    cfg.global_batch_info.update(info)
    return get_policy_loss_fn(name)(
        old_log_prob=b.old,
        log_prob=padded(b, lp),
        advantages=b.adv,
        response_mask=b.mask,
        loss_agg_mode=cfg.loss_agg_mode,
        config=cfg,
        rollout_is_weights=weights,
    )


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "geo_mean", "dppo_tv", "dppo_kl", "kl_cov", "dro", "cispo", "gpg",
                                  "sapo"])  # fmt: skip
def test_metrics_under_verl_names_equal_verl(mode):
    """Every metric verl reports is there, under verl's name, with verl's value (a dashboard keyed on
    verl's names finds them all)."""
    b = make_batch(300, rows=8, empty=(2,))
    b.old[0, 3] = b.old[0, 3] - 2.0  # a ratio past the dual clip for a negative advantage
    b.adv[0, 3] = -1.0
    cfg = actor_config(mode, "token-mean", kl=None, entropy=0.0)
    if mode in COV:
        cfg = dataclasses.replace(cfg, policy_loss=dataclasses.replace(cfg.policy_loss, **COV[mode]))
    lp, _ = leaves(b)
    info = dict(dp_size=1, batch_num_tokens=int(b.mask.sum()), global_batch_size=8)
    _, native = direct_call(mode, cfg, b, lp, **info)
    _, ours = direct_call(PREFIX + mode, cfg, b, lp, **info)
    assert set(native) <= set(ours), sorted(set(native) - set(ours))
    shared = set(native)
    assert "actor/ppo_kl" in shared or mode == "gpg"  # verl's gpg reports no metric
    if mode in ("vanilla", "gspo", "geo_mean", "dppo_tv", "dppo_kl"):
        assert "actor/pg_clipfrac" in shared
    if mode in ("vanilla", "geo_mean", "dppo_tv", "dppo_kl"):
        assert "actor/pg_clipfrac_lower" in shared
    for key in sorted(shared):
        assert abs(float(ours[key]) - native[key]) <= 1e-6 * max(1.0, abs(native[key])), (key, ours[key], native[key])
    assert any(native[k] != 0 for k in shared if "clipfrac" in k) or mode in ("kl_cov", "dro", "gpg", "sapo")
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in ours.values())
    assert any(k.startswith("actor/packloss/") for k in ours)


@pytest.mark.parametrize(
    "loss_type, rc",
    [
        ("ppo_clip", {"rollout_is": "token", "rollout_is_threshold": 2.0}),
        ("ppo_clip", {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.6_2.5"}),
        ("reinforce", {"rollout_is": "sequence", "rollout_is_threshold": "0.5_5.0"}),
    ],
)
def test_bypass_mode_returns_verls_rollout_corr_diagnostics(loss_type, rc):
    """packloss_bypass_mode returns every metric verl's bypass_mode returns, ``rollout_corr/*`` included,
    with verl's values."""
    rc = RolloutCorrectionConfig(bypass_mode=True, loss_type=loss_type, **({"rollout_is": None} | rc))
    cfg = actor_config(f"bypass:{loss_type}", "token-mean", kl=None, entropy=0.0, rollout=rc)
    b = make_batch(310, rows=8, empty=(2,))
    lp, _ = leaves(b)
    info = dict(dp_size=1, batch_num_tokens=int(b.mask.sum()), global_batch_size=8)
    _, native = direct_call("bypass_mode", cfg, b, lp, **info)
    _, ours = direct_call(PREFIX + "bypass_mode", cfg, b, lp, **info)
    diagnostics = {k for k in native if k.startswith("rollout_corr/")}
    assert len(diagnostics) >= 5 and set(native) <= set(ours), sorted(set(native) - set(ours))
    for key in sorted(diagnostics):
        assert float(ours[key]) == pytest.approx(native[key], rel=1e-6, abs=1e-9), key


def random_padded(rows: int, width: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, width + 1, (rows, 1), generator=g)
    mask = (torch.arange(width) < lens) & (torch.rand(rows, width, generator=g) > 0.1)
    old = -3 * torch.rand(rows, width, generator=g)
    return {
        "old_log_prob": old,
        "log_prob": (old + 0.3 * torch.randn(rows, width, generator=g)).requires_grad_(),
        "advantages": torch.randn(rows, 1, generator=g).expand(rows, width).clone(),
        "response_mask": mask,
        "rollout_is_weights": torch.rand(rows, width, generator=g) * 2,
    }


@pytest.mark.parametrize(
    "mode, agg",
    [
        ("vanilla", "token-mean"),
        ("gspo", "seq-mean-token-mean"),
        ("geo_mean", "token-mean"),
        ("sapo", "seq-mean-token-sum-norm"),
        ("clip_cov", "token-mean"),
        ("bypass_mode", "seq-mean-token-sum"),
        ("topr", "seq-mean-token-sum"),
    ],
)
def test_sync_free_and_flat_in_the_number_of_rows(monkeypatch, mode, agg):
    """Forward and backward with no device→host read and the same op count for 2, 8 and 32 rows
    (bypass mode's loss: verl's ``rollout_corr/*`` diagnostics are host floats from verl's own helper)."""
    monkeypatch.setattr(verl_plugin, "rollout_corr_metrics", lambda *a: {})
    counts = set()
    name = "bypass:ppo_clip" if mode == "bypass_mode" else mode
    cfg = actor_config(name, agg, kl=None, entropy=0.0)
    for rows in (2, 8, 32):
        batch = random_padded(rows, seed=rows)
        cfg.global_batch_info.clear()
        cfg.global_batch_info.update(dp_size=2, batch_num_tokens=1000, global_batch_size=64)
        fn = get_policy_loss_fn(PREFIX + mode)
        with OpCounter() as counter:
            loss, metrics = fn(loss_agg_mode=agg, config=cfg, **batch)
            loss.backward()
        assert counter.num_syncs == 0, counter.syncs
        counts.add(counter.total)
    assert len(counts) == 1, counts


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "geo_mean", "cispo", "dppo_kl", "kl_cov", "bypass_mode", "dppo"])
def test_padding_may_hold_nan_and_inf(mode):
    """Values off the response mask (log-probs, old, advantages, weights) change nothing."""
    name = "bypass:reinforce" if mode == "bypass_mode" else mode
    rc = RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", rollout_is="token")
    cfg = actor_config(name, "seq-mean-token-mean", kl=None, entropy=0.0, rollout=rc if mode == "bypass_mode" else None)
    if mode == "kl_cov":
        cfg = dataclasses.replace(cfg, policy_loss=dataclasses.replace(cfg.policy_loss, **COV[mode]))
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=500, global_batch_size=8)
    clean = random_padded(8, seed=5)
    off = ~clean["response_mask"]
    poisoned = {k: v.detach().clone() for k, v in clean.items()}
    for key, bad in (("log_prob", math.nan), ("old_log_prob", math.inf), ("advantages", math.nan)):
        poisoned[key][off] = bad
    poisoned["rollout_is_weights"][off] = -math.inf
    poisoned["log_prob"].requires_grad_(True)
    fn = get_policy_loss_fn(PREFIX + mode)
    loss, metrics = fn(loss_agg_mode=cfg.loss_agg_mode, config=cfg, **clean)
    loss_p, metrics_p = fn(loss_agg_mode=cfg.loss_agg_mode, config=cfg, **poisoned)
    assert torch.isfinite(loss) and torch.equal(loss.detach(), loss_p.detach())
    g, g_p = torch.autograd.grad(loss, clean["log_prob"])[0], torch.autograd.grad(loss_p, poisoned["log_prob"])[0]
    assert torch.equal(g, g_p) and bool((g_p[off] == 0).all()) and bool(g.abs().sum() > 0)
    for key, value in metrics.items():  # bypass mode's rollout_corr/* are verl's floats
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(metrics_p[key])), key


def test_clear_errors():
    b = make_batch(310)
    lp, _ = leaves(b)
    cfg = actor_config("vanilla", kl=None, entropy=0.0)
    fn = get_policy_loss_fn("packloss_vanilla")
    kw = dict(old_log_prob=b.old, log_prob=padded(b, lp), advantages=b.adv, response_mask=b.mask)
    with pytest.raises(ValueError, match="config must be"):
        fn(**kw, config=None)
    with pytest.raises(ValueError, match="loss_agg_mode must be one of"):
        fn(**kw, loss_agg_mode="token-max", config=cfg)
    with pytest.raises(ValueError, match=r"advantages must have shape \[B, T\]"):
        fn(**(kw | {"advantages": b.adv[:, :3]}), config=cfg)
    cfg.global_batch_info.clear()
    cfg.global_batch_info.update(dp_size=2, batch_num_tokens=None, global_batch_size=8)
    with pytest.raises(ValueError, match="dp_size=2 needs config.global_batch_info\\['batch_num_tokens'\\]"):
        fn(**kw, config=cfg)
    cfg.global_batch_info.update(dp_size=2.5)
    with pytest.raises(TypeError, match="dp_size"):
        fn(**kw, config=cfg)
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=float("nan"))
    with pytest.raises(ValueError, match="batch_num_tokens"):
        fn(**kw, config=cfg)
    rc = RolloutCorrectionConfig(bypass_mode=True, rollout_is=None, rollout_rs="seq_max_k2", rollout_rs_threshold=0.1)
    bypass = actor_config("bypass:ppo_clip", kl=None, entropy=0.0, rollout=rc)
    with pytest.raises(NotImplementedError, match="seq_max_k2"):
        get_policy_loss_fn("packloss_bypass_mode")(**kw, config=bypass)
