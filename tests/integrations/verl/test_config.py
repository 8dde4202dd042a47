"""``from_verl``: each mapped verl option equals verl 0.9.1's own loss code (one call and a step), every
difference is a test, and unmapped options raise naming the option."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
import verl
from omegaconf import OmegaConf
from verl.protocol import DataProto
from verl.trainer.config import RolloutCorrectionConfig
from verl.trainer.ppo.core_algos import agg_loss, kl_penalty_forward
from verl.trainer.ppo.rollout_corr_helper import (
    compute_rollout_correction_and_add_to_batch,
    compute_rollout_rejection_mask,
)
from verl.utils.config import omega_conf_to_dataclass

from packloss import (
    TRUST_REGIONS,
    Normalize,
)
from packloss.core.trust_regions import PPOClip
from packloss.integrations.verl import LOSS_AGG_MODES, VERL_VERSION, from_verl, rejection_mask
from packloss.integrations.verl.config import K3_CAP, k3_band
from tests.integrations.verl.harness import (
    BYPASS_RS,
    EPS,
    F64,
    IS_SPECS,
    MODES,
    RS_SPECS,
    RTOL,
    actor_config,
    assert_close,
    case,
    compare,
    cov_config,
    describe,
    first_epoch,
    grads,
    leaves,
    make_batch,
    packloss_step,
    region_ready,
    token,
    verl_micro,
    verl_step,
    verl_weights,
)


def test_installed_verl_is_the_mapped_release():
    assert verl.__version__ == VERL_VERSION


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("mode", MODES)
def test_one_call_matches_verl(mode, agg):
    """One micro-batch on one rank: verl's ``ppo_loss`` (policy loss + KL + entropy) on the padded batch
    vs packloss on the packed one, loss and gradient within 1e-10."""
    cfg, recipe = case(mode, agg, rows=8)
    b = make_batch(MODES.index(mode))
    old = b.rollout if mode.startswith("bypass") else None  # bypass: old_log_prob = rollout_log_prob
    compare(cfg, recipe, b, [[list(range(8))]], bypass=old is not None, mode=mode, verl_kw={"old": old})


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ranks", [1, 2])
def test_step_over_micro_batches_matches_verl(mode, agg, ranks):
    """A step of 12 rows: 1 rank × 3 micro-batches or 2 ranks × 2 micro-batches. verl runs ``ppo_loss``
    per micro-batch with the engine's global ``batch_num_tokens`` / ``global_batch_size`` / ``dp_size``
    and sums the gradients (FSDP then averages the ranks); packloss sums ``compute_loss`` over the
    micro-batches with ``count_denominators`` of the step. (verl's sum over micro-batches equals one
    call on the whole mini-batch with the same global arguments, except geo_mean: see
    ``test_geo_mean_depends_on_the_split``.)"""
    cfg, recipe = case(mode, agg, rows=12)
    b = make_batch(100 + MODES.index(mode), rows=12, empty=(2, 7))
    split = (
        [[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]]
        if ranks == 1
        else [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10, 11]]]
    )
    old = b.rollout if mode.startswith("bypass") else None
    compare(cfg, recipe, b, split, bypass=old is not None, mode=mode, verl_kw={"old": old})
    if mode != "geo_mean":  # the sum over micro-batches is one call with the same global arguments
        lp, ent = leaves(b)
        kw = dict(dp_size=ranks, num_tokens=int(b.mask.sum()), global_batch_size=12, old=old)
        whole = verl_micro(cfg, b, list(range(12)), lp, ent, **kw) / ranks
        assert_close(whole.detach(), verl_step(cfg, b, split, lp, ent, old=old).detach(), "one call vs the step")


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("mode", ["clip_cov", "kl_cov"])
def test_covariance_modes_match_verl_on_one_micro_batch_first_epoch(mode, agg):
    """Clip-Cov / KL-Cov where verl's choice is packloss's: one micro-batch (its covariance is the
    step's), the first epoch (the live log π is the old one) and, for clip_cov, ``k`` at least the
    band (verl's random draw takes every band token)."""
    if mode not in TRUST_REGIONS:
        with pytest.raises(NotImplementedError, match=f"no '{mode}' trust region"):
            from_verl(cov_config(mode, agg, 8), response_length=12)
        pytest.fail(f"packloss has no {mode!r} trust region in this checkout")
    cfg = cov_config(mode, agg, 8)
    b = first_epoch(make_batch(40 + LOSS_AGG_MODES.index(agg)), 1)
    v, _ = compare(cfg, from_verl(cfg, response_length=12), b, [[list(range(8))]], mode=mode)
    # the selection bites: verl without it (an empty band / a zero coefficient) is another loss
    off = {"clip_cov": dict(clip_cov_lb=100.0, clip_cov_ub=101.0), "kl_cov": dict(ppo_kl_coef=0.0)}[mode]
    plain = dataclasses.replace(cfg, policy_loss=dataclasses.replace(cfg.policy_loss, **off))
    lp, ent = leaves(b)
    g = torch.autograd.grad(verl_step(cfg, b, [[list(range(8))]], lp, ent), lp)[0]
    g_plain = torch.autograd.grad(verl_step(plain, b, [[list(range(8))]], lp, ent), lp)[0]
    assert (g - g_plain).abs().max() > 1e-3 * g.abs().max()


def test_covariance_selection_over_micro_batches_differs():
    """verl's KL-Cov picks its top-k per micro-batch (its means, its k); packloss over the step."""
    if "kl_cov" not in TRUST_REGIONS:
        pytest.fail("packloss has no 'kl_cov' trust region in this checkout")
    cfg = cov_config("kl_cov", "token-mean", 12)
    b = first_epoch(make_batch(45, rows=12, empty=(2, 7)), 2)
    recipe = from_verl(cfg)
    lp, ent = leaves(b)
    whole, split = [[list(range(12))]], [[list(range(6)), list(range(6, 12))]]
    per_micro = torch.autograd.grad(verl_step(cfg, b, split, lp, ent), lp)[0]
    one_call = torch.autograd.grad(verl_step(cfg, b, whole, lp, ent), lp)[0]
    ours_split = torch.autograd.grad(packloss_step(recipe, b, split, lp, ent), lp)[0]
    assert_close(ours_split, one_call, "packloss's split step = verl's whole-batch selection")
    assert (per_micro - one_call).abs().max() > 1e-3 * one_call.abs().max()


@pytest.mark.parametrize("rs, rs_threshold", RS_SPECS)
@pytest.mark.parametrize("level, threshold", IS_SPECS)
@pytest.mark.parametrize(
    "mode, agg", [("vanilla", "token-mean"), ("cispo", "seq-mean-token-sum"), ("gspo", "seq-mean-token-mean")]
)
def test_decoupled_rollout_correction_matches_verl(mode, agg, level, threshold, rs, rs_threshold):
    """The trainer's decoupled correction (``algorithm.rollout_correction``): IS weights and rejection
    from ``old_log_prob`` vs ``rollout_log_prob`` on the whole batch (verl's
    ``compute_rollout_correction_and_add_to_batch``), then the step on the new response mask.
    packloss: the recipe's RolloutCorrection and ``rejection_mask`` as the member mask."""
    rc = RolloutCorrectionConfig(
        rollout_is=level, rollout_is_threshold=threshold, rollout_rs=rs, rollout_rs_threshold=rs_threshold
    )
    cfg = actor_config(mode, agg, rows=12)
    b = make_batch(7, rows=12, empty=(3,))
    token_rs = rs is not None and "token" in rs
    if token_rs and level == "sequence":
        with pytest.raises(NotImplementedError, match="rollout_rs"):
            from_verl(cfg, rollout_correction=rc)
        return
    recipe = from_verl(cfg, rollout_correction=rc)
    batch = DataProto.from_dict(
        tensors={"old_log_probs": b.old, "rollout_log_probs": b.rollout, "response_mask": b.mask.long()}
    )
    batch, _ = compute_rollout_correction_and_add_to_batch(batch, rc)
    verl_mask = batch.batch["response_mask"].bool()
    verl_w = batch.batch["rollout_is_weights"] if level is not None else None
    ours = rejection_mask(rc, b.packed(b.old), b.packed(b.rollout), b.packed(b.mask), b.resp_lens)
    assert torch.equal(ours, b.packed(verl_mask))
    if rs is not None:
        assert 0 < int(verl_mask.sum()) < int(b.mask.sum()), "the rejection should reject some, not all"
    split = [[[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]]
    compare(cfg, recipe, b, split, mask_packed=ours, mode=mode, verl_kw={"mask": verl_mask, "weights": verl_w})


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("rs, rs_threshold", BYPASS_RS)
@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_rejection_matches_verl(loss_type, rs, rs_threshold, agg):
    """Bypass mode: verl rejects inside the loss, from the current ``log_prob``; the rejected tokens
    leave the policy term's numerator only (a masking band with ``weighted=False`` here)."""
    rc = RolloutCorrectionConfig(
        bypass_mode=True, loss_type=loss_type, rollout_is=None, rollout_rs=rs, rollout_rs_threshold=rs_threshold
    )
    cfg = actor_config(f"bypass:{loss_type}", agg, rollout=rc, rows=12)
    if agg == "seq-mean-token-mean" and rs.startswith("token"):
        with pytest.raises(NotImplementedError, match="seq-mean-token-mean"):
            from_verl(cfg)
        return
    if loss_type == "reinforce" and not region_ready("bypass:reinforce"):
        pytest.fail("packloss has no 'gpg' trust region in this checkout")
    b = make_batch(11, rows=12, empty=(3,))
    padded_logp = torch.zeros_like(b.old).masked_scatter(b.valid, b.logp)
    kept, _ = compute_rollout_rejection_mask(padded_logp - b.rollout, b.mask.long(), rs, rs_threshold)
    assert 0 < int(kept.sum()) < int(b.mask.sum()), "verl's rejection should reject some members, not all"
    split = [[[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]]
    compare(cfg, from_verl(cfg), b, split, bypass=True, mode="bypass_mode", verl_kw={"old": b.rollout})


@pytest.mark.parametrize("level, threshold", IS_SPECS[:4])
def test_bypass_reinforce_importance_weights_match_verl(level, threshold):
    """Bypass REINFORCE: ``−A · log π · w`` with verl's IS weights from the current ``log_prob``."""
    if not region_ready("bypass:reinforce"):
        pytest.fail("packloss has no 'gpg' trust region in this checkout")
    rc = RolloutCorrectionConfig(
        bypass_mode=True, loss_type="reinforce", rollout_is=level, rollout_is_threshold=threshold
    )
    cfg = actor_config("bypass:reinforce", "seq-mean-token-sum", rollout=rc, rows=12)
    b = make_batch(12, rows=12, empty=(3,))
    compare(
        cfg,
        from_verl(cfg),
        b,
        [[list(range(6)), list(range(6, 12))]],
        bypass=True,
        mode="bypass_mode",
        verl_kw={"old": b.rollout},
    )


def test_bypass_ppo_clip_ignores_importance_weights():
    """verl computes bypass PPO-clip's IS weights for its metrics only: the recipe has no correction."""
    rc = RolloutCorrectionConfig(bypass_mode=True, loss_type="ppo_clip", rollout_is="token")
    cfg = actor_config("bypass:ppo_clip", rollout=rc)
    recipe = from_verl(cfg)
    assert recipe.components["pg"].loss.correction is None
    b = make_batch(13)
    compare(cfg, recipe, b, [[list(range(8))]], bypass=True, verl_kw={"old": b.rollout})


def test_vanilla_log_ratio_clamp_differs():
    """verl clamps ``log r`` at −20: a token with ``log r = −25`` and ``A > 0`` has verl's gradient 0."""
    b = make_batch(31)
    b.mask[0, 0], b.adv[0, 0] = True, 1.0
    b.logp[token(b, 0, 0)], b.old[0, 0] = -30.0, -5.0
    cfg = actor_config("vanilla", kl=None, entropy=0.0)
    v, p, gv, gp = grads(cfg, from_verl(cfg), b)
    t = token(b, 0, 0)
    assert gv[t] == 0 and gp[t] != 0
    keep = torch.ones_like(gv, dtype=torch.bool)
    keep[t] = False
    assert_close(gp[keep], gv[keep], "the other tokens")
    assert abs(p - v) > RTOL * abs(v)  # r = e^−25 vs verl's e^−20 in the value


def test_gspo_sequence_ratio_clamp_differs():
    """verl clamps ``log s_{i,t}`` at 10: with ``A < 0`` and ``log s_i > 10`` verl's row has no gradient."""
    b = make_batch(32)
    b.adv[0] = -1.0
    b.old[0] = b.logp[: b.resp_lens[0]] - 12.0  # log s_0 = 12 > 10
    cfg = actor_config("gspo", kl=None, entropy=0.0)
    v, p, gv, gp = grads(cfg, from_verl(cfg), b)
    row0 = slice(0, b.resp_lens[0])
    assert bool((gv[row0] == 0).all()) and bool((gp[row0][b.mask[0, : b.resp_lens[0]]] != 0).all())
    assert_close(gp[b.resp_lens[0] :], gv[b.resp_lens[0] :], "the other rows")


def test_low_var_kl_clamp_differs():
    """verl clamps ``low_var_kl`` at 10: ``ref − log π = 3`` (k3 ≈ 16.1) has verl's KL gradient 0."""
    b = make_batch(33)
    t = token(b, 0, 0)
    b.ref[0, 0] = b.logp[t] + 3.0
    cfg = actor_config("vanilla", kl="low_var_kl", entropy=0.0)
    v, p, gv, gp = grads(cfg, from_verl(cfg), b)
    cfg_no_kl = actor_config("vanilla", kl=None, entropy=0.0)
    _, _, gv_pg, _ = grads(cfg_no_kl, from_verl(cfg_no_kl), b)
    assert gv[t] == gv_pg[t] and gp[t] != gv[t]  # verl: the policy gradient only


def test_low_var_kl_note_is_where_verls_own_clamp_stops_the_gradient():
    """The band of ``from_verl``'s note: verl's ``kl_penalty_forward`` has a k3 gradient just inside
    ``k3_band(10)`` and none just outside it (verl also clamps ``x`` to ±20 first)."""
    low, high = k3_band(K3_CAP)
    assert math.expm1(high) - high == pytest.approx(K3_CAP, rel=1e-14)
    assert math.expm1(low) - low == pytest.approx(K3_CAP, rel=1e-14)
    x = torch.tensor([high - 1e-6, high + 1e-6, low + 1e-6, low - 1e-6], dtype=F64)  # x = ref − log π
    logprob = torch.zeros(4, dtype=F64, requires_grad=True)
    (grad,) = torch.autograd.grad(kl_penalty_forward(logprob, x, "low_var_kl").sum(), logprob)
    assert [g != 0 for g in grad.tolist()] == [True, False, True, False]
    note = " ".join(from_verl(actor_config("vanilla", kl="low_var_kl", entropy=0.0)).notes)
    assert f"> {high:.4f}" in note and f"{high:.4f}" == "2.6109"


def test_seq_mean_eps_is_lost_to_float32():
    """verl's ``Σ / (n_s + 1e-8)``: with its bool / integer response mask ``n_s + 1e-8`` is a float32
    ``n_s`` and packloss's ``Σ / n_s`` agrees exactly (the agreement tests); with a float64 mask the eps
    would count (a relative ``1e-8 / n_s``)."""
    b = make_batch(34, empty=())
    loss = b.old - b.ref  # any [B, T] values
    as_bool = agg_loss(loss, b.mask, "seq-mean-token-mean")
    as_float = agg_loss(loss, b.mask.to(F64), "seq-mean-token-mean")
    n = b.mask.sum(-1).to(F64)
    exact = ((loss * b.mask).sum(-1) / n).mean()
    assert as_bool == exact
    assert_close(as_float, ((loss * b.mask).sum(-1) / (n + EPS)).mean(), "verl with a float mask")
    assert abs(as_float - exact) > 1e-12 * abs(exact)


@pytest.mark.parametrize("agg", ["seq-mean-token-sum", "seq-mean-token-mean"])
def test_sequences_without_members_counted_by_verl(agg):
    """verl's engine passes ``global_batch_size = ppo_mini_batch_size × rollout_n``, every row, also the
    two whose response mask is all zero; packloss counts the 6 rows with members. Without the global
    size (verl's local fallback) verl counts the rows with members too."""
    b = make_batch(35)  # rows 2 and 5 without members
    cfg = actor_config("vanilla", agg, kl=None, entropy=0.0)
    recipe = from_verl(cfg)
    v, p, _, _ = grads(cfg, recipe, b)
    eps_only = verl_weights(b, "vanilla", b.packed(b.mask), [[[0]]])
    lp, ent = leaves(b)
    p_eps = packloss_step(recipe, b, [[list(range(8))]], lp, ent, weights=eps_only)
    assert_close(p_eps.detach(), v, "packloss × S_m / G (and the eps)")
    assert abs(p - v) > 0.1 * abs(v)  # 6/8 of packloss's
    local = verl_micro(cfg, b, list(range(8)), lp, ent, dp_size=1, num_tokens=int(b.mask.sum()), global_batch_size=None)
    if agg == "seq-mean-token-sum":
        assert_close(local.detach(), p, "verl's local count")


def test_loss_scale_factor_none_is_the_padded_width():
    """``seq-mean-token-sum-norm`` with ``loss_scale_factor=None``: verl divides by the padded width, so
    the same responses padded wider give a smaller loss; packloss has no width and needs
    ``response_length`` (or raises)."""
    b = make_batch(36)
    cfg = actor_config("vanilla", "seq-mean-token-sum-norm", kl=None, entropy=0.0)
    with pytest.raises(ValueError, match="response_length"):
        from_verl(cfg)
    lp, ent = leaves(b)
    kw = dict(dp_size=1, num_tokens=int(b.mask.sum()), global_batch_size=8)
    narrow = verl_micro(cfg, b, list(range(8)), lp, ent, **kw).detach()
    wide = verl_micro(cfg, b, list(range(8)), lp, ent, width=b.width + 5, **kw).detach()
    assert_close(wide * (b.width + 5), narrow * b.width, "verl's loss × its padded width")
    p = packloss_step(from_verl(cfg, response_length=b.width), b, [[list(range(8))]], lp, ent).detach()
    assert_close(p, narrow, "packloss with response_length = T")
    fixed = actor_config("vanilla", "seq-mean-token-sum-norm", kl=None, entropy=0.0, scale=7)
    assert_close(
        packloss_step(from_verl(fixed), b, [[list(range(8))]], lp, ent).detach(),
        verl_micro(fixed, b, list(range(8)), lp, ent, width=b.width + 5, **kw).detach(),
        "loss_scale_factor=7",
    )


def test_geo_mean_depends_on_the_split():
    """verl's ``geo_mean`` is a mean over each call's rows summed over micro-batches: the same step
    split into 1, 2 or 3 micro-batches gives verl three losses (1×, 2×, 3× the mean without member-less
    rows); packloss's step loss is one."""
    if not region_ready("geo_mean"):
        pytest.fail("packloss has no 'geo_mean' trust region in this checkout")
    b = make_batch(37, rows=12, empty=())
    cfg = actor_config("geo_mean", kl=None, entropy=0.0, rows=12)
    recipe = from_verl(cfg)
    lp, ent = leaves(b)
    splits = [
        [[list(range(12))]],
        [[list(range(6)), list(range(6, 12))]],
        [[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]],
    ]
    verl_losses = [verl_step(cfg, b, s, lp, ent).detach() for s in splits]
    ours = [packloss_step(recipe, b, s, lp, ent).detach() for s in splits]
    for k in (1, 2):
        assert_close(ours[k], ours[0], "packloss's step")
        assert_close(verl_losses[k], (k + 1) * verl_losses[0], "verl's step × micro-batches")
    assert_close(ours[0], verl_losses[0], "one micro-batch without member-less rows")


def test_rollout_is_safety_clamp_differs():
    """verl clamps the IS log-ratio at −20: a token with ``old − rollout = −25`` gets weight e^−20."""
    b = make_batch(38)
    t = token(b, 0, 1)
    b.mask[0, 1], b.adv[0, 1] = True, 1.0
    b.old[0, 1] = b.logp[t] - 0.1  # the PPO ratio stays inside the clip
    b.rollout[0, 1] = b.old[0, 1] + 25.0  # old − rollout = −25
    rc = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)
    cfg = actor_config("vanilla", kl=None, entropy=0.0)
    batch = DataProto.from_dict(
        tensors={"old_log_probs": b.old, "rollout_log_probs": b.rollout, "response_mask": b.mask.long()}
    )
    batch, _ = compute_rollout_correction_and_add_to_batch(batch, rc)
    w = batch.batch["rollout_is_weights"]
    assert w[0, 1] == math.exp(-20.0)
    v, p, gv, gp = grads(cfg, from_verl(cfg, rollout_correction=rc), b, verl_kw={"weights": w})
    assert gv[t] != 0 and abs(gp[t] / gv[t] - math.exp(-5.0)) < 1e-6  # e^−25 / e^−20


@pytest.mark.parametrize("mode", ["vanilla", "sapo", "dro", "bypass:reinforce"])
def test_dataclass_omegaconf_and_dict_configs_agree(mode):
    if not region_ready(mode):
        pytest.fail("trust region not in this checkout")
    cfg = actor_config(mode, "seq-mean-token-sum-norm", kl="k2", scale=512)
    as_dict = dataclasses.asdict(cfg)
    expected = describe(from_verl(cfg))
    assert describe(from_verl(OmegaConf.create(as_dict))) == expected
    assert describe(from_verl(as_dict)) == expected


def test_verl_default_trainer_config():
    """verl's own generated trainer config (interpolations and all), as a DictConfig and as the
    FSDPActorConfig verl instantiates from it: vanilla PPO clip 0.2, dual clip 3, token-mean."""
    path = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    actor = OmegaConf.load(path).actor_rollout_ref.actor
    actor.ppo_micro_batch_size_per_gpu = 2
    recipe = from_verl(actor)
    assert describe(from_verl(omega_conf_to_dataclass(actor))) == describe(recipe)
    pg = recipe.components["pg"]
    assert list(recipe.components) == ["pg"] and pg.normalize is Normalize.TOKEN
    assert pg.loss.trust_region == PPOClip(0.2, 0.2, dual_clip_c=3.0) and pg.loss.penalties == ()
    actor.loss_agg_mode = "seq-mean-token-sum-norm"
    with pytest.raises(ValueError, match="response_length"):
        from_verl(actor)
    assert from_verl(actor, response_length=1024).components["pg"].constant == 256 * 1 * 1024  # mini-batch × n × T


def test_the_recipe_parts():
    cfg = actor_config("vanilla", "seq-mean-token-mean", kl="k1", entropy=0.02)
    recipe = from_verl(cfg)
    assert list(recipe.components) == ["pg", "entropy"]
    pg = recipe.components["pg"].loss
    assert (pg.trust_region.clip_low, pg.trust_region.clip_high, pg.trust_region.dual_clip_c) == (0.2, 0.28, 3.0)
    assert (pg.penalties[0].coef, pg.penalties[0].estimator, pg.penalties[0].against) == (0.05, "k1", "ref")
    assert recipe.components["entropy"].loss.coef == 0.02
    assert {p.normalize for p in recipe.components.values()} == {Normalize.SEQUENCE_MEAN}
    if region_ready("sapo"):  # sapo's own aggregation moves the KL term into its own part
        sapo = from_verl(actor_config("sapo", "token-mean"))
        assert list(sapo.components) == ["pg", "kl", "entropy"]
        assert (
            sapo.components["pg"].normalize is Normalize.SEQUENCE_MEAN
            and sapo.components["kl"].normalize is Normalize.TOKEN
        )
    norm = from_verl(actor_config("vanilla", "seq-mean-token-sum-norm", scale=100, rows=8))
    assert norm.components["pg"].constant == 8 * 100  # ppo_mini_batch_size × rollout_n × loss_scale_factor


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: from_verl(actor_config("vanilla", kl="abs")), NotImplementedError, "kl_loss_type='abs'"),
        (lambda: from_verl(actor_config("vanilla", kl="full")), NotImplementedError, "kl_loss_type='full'"),
        (lambda: from_verl({"policy_loss": {"loss_mode": "nope"}}), NotImplementedError, "loss_mode='nope'"),
        (lambda: from_verl({"loss_agg_mode": "token-max"}), NotImplementedError, "loss_agg_mode='token-max'"),
        (lambda: from_verl({"policy_loss": {"loss_mode": "dro"}}), ValueError, "dro_beta"),
        (lambda: from_verl({"loss_agg_mode": "seq-mean-token-sum-norm"}), ValueError, "response_length"),
        (lambda: from_verl({"loss_agg_mode": "seq-mean-token-sum-norm"}, response_length=8), ValueError, "rollout_n"),
        (
            lambda: from_verl({}, rollout_correction={"rollout_is": "token", "rollout_is_batch_normalize": True}),
            NotImplementedError,
            "rollout_is_batch_normalize",
        ),
        (
            lambda: from_verl({}, rollout_correction={"rollout_is": "geometric"}),
            NotImplementedError,
            "rollout_is='geometric'",
        ),
        (
            lambda: from_verl({}, rollout_correction={"rollout_rs": "token_k9", "rollout_rs_threshold": 1.0}),
            NotImplementedError,
            "rollout_rs='token_k9'",
        ),
        (lambda: from_verl({}, rollout_correction={"rollout_rs": "token_k1"}), ValueError, "rollout_rs_threshold"),
        (
            lambda: from_verl(
                {}, rollout_correction={"bypass_mode": True, "rollout_rs": "seq_sum_k2", "rollout_rs_threshold": 0.1}
            ),
            NotImplementedError,
            "seq_sum_k2",
        ),
        (
            lambda: from_verl(
                {},
                rollout_correction={
                    "bypass_mode": True,
                    "rollout_rs": "token_k1,token_k2",
                    "rollout_rs_threshold": 2.0,
                },
            ),
            NotImplementedError,
            "one criterion",
        ),
        (
            lambda: from_verl(
                {},
                rollout_correction={
                    "bypass_mode": True,
                    "loss_type": "reinforce",
                    "rollout_is": "token",
                    "rollout_rs": "token_k1",
                    "rollout_rs_threshold": 2.0,
                },
            ),
            NotImplementedError,
            "both rollout_is and rollout_rs",
        ),
        (
            lambda: from_verl({}, rollout_correction={"bypass_mode": True, "loss_type": "dpo"}),
            NotImplementedError,
            "loss_type='dpo'",
        ),
        (lambda: from_verl({"policy_loss": {"loss_mode": "bypass_mode"}}), ValueError, "rollout_correction"),
        (lambda: from_verl({"entropy_coeff": float("nan")}), ValueError, "entropy_coeff must be finite"),
        (lambda: from_verl({"clip_ratio_c": 1.0}), ValueError, r"^actor_config\.clip_ratio_c must be > 1"),
        (lambda: from_verl(None), TypeError, "actor_config must be"),
        (lambda: from_verl({"kl_loss_coef": "0.1", "use_kl_loss": True}), TypeError, "kl_loss_coef must be a number"),
    ],
)
def test_unmappable_settings_raise_naming_the_option(build, error, match):
    with pytest.raises(error, match=match):
        build()


@pytest.mark.parametrize(
    "actor, rollout_correction, option",
    [
        ({"clip_ratio_c": 0.5}, None, "actor_config.clip_ratio_c"),
        ({"clip_ratio_low": 1.5}, None, "actor_config.clip_ratio_low (or clip_ratio)"),
        ({"clip_ratio": -0.1}, None, "actor_config.clip_ratio_low (or clip_ratio)"),
        ({"policy_loss": {"loss_mode": "sapo"}, "tau_pos": 0}, None, "actor_config.tau_pos"),
        ({"policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": 2}}, None, "actor_config.policy_loss.kl_cov_ratio"),
        ({"policy_loss": {"loss_mode": "dppo_tv"}, "clip_ratio_c": -1}, None, "actor_config.clip_ratio_c"),
        ({}, {"rollout_is": "token", "rollout_is_threshold": -1.0}, "rollout_correction.rollout_is_threshold"),
    ],
)
def test_a_bad_setting_is_named_as_verl_names_it(actor, rollout_correction, option):
    """Not as the packloss field it becomes (``PPOClip.dual_clip_c``, ``SAPO.tau_pos``, ...)."""
    with pytest.raises(ValueError) as raised:
        from_verl(actor, rollout_correction=rollout_correction)
    message = str(raised.value)
    assert message.startswith(option), message
    assert not re.search(r"\b(PPOClip|GSPO|SAPO|KLCov|ClipCov|DPPOTV|RolloutCorrection)\.", message), message


def test_unmapped_corrections_raise():
    with pytest.raises(NotImplementedError, match="rollout_is with loss_mode='dro'"):
        from_verl({"policy_loss": {"loss_mode": "dro", "dro_beta": 0.1}}, rollout_correction={"rollout_is": "token"})
    with pytest.raises(NotImplementedError, match="rollout_is with loss_mode='geo_mean'"):
        from_verl({"policy_loss": {"loss_mode": "geo_mean"}}, rollout_correction={"rollout_is": "sequence"})
