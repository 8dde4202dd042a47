"""packloss.integrations.verl against verl 0.9.1's own code, in float64.

verl's side is called as its engine calls it: ``verl.workers.utils.losses.ppo_loss`` once per
micro-batch, with the model output as nested (prompt + response) tensors, the padded ``[b, T]`` batch
fields and the engine's ``dp_size`` / ``batch_num_tokens`` / ``global_batch_size``; the decoupled
rollout correction comes from the trainer's ``compute_rollout_correction_and_add_to_batch``. Its
gradient is that of ``Σ_{ranks, micro-batches} loss / dp_size`` (each micro-batch's ``backward`` adds
up, FSDP averages the ranks). packloss's side runs on the packed layout (each row's response tokens
concatenated; rows whose response mask is all zero stay, as sequences without members) with step
denominators. Both sides share one leaf tensor of trainer log-probs and one of entropies.

Where verl's semantics differ from packloss's (the module doc of ``packloss.integrations.verl``), the
agreement tests apply the documented difference as per-token weights on the packloss side
(:func:`verl_weights`) and separate tests assert that without them the two differ.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import verl
from omegaconf import OmegaConf
from tensordict import TensorDict
from torch import Tensor
from verl.protocol import DataProto
from verl.trainer.config import RolloutCorrectionConfig
from verl.trainer.ppo.core_algos import agg_loss
from verl.trainer.ppo.rollout_corr_helper import (
    compute_rollout_correction_and_add_to_batch,
    compute_rollout_rejection_mask,
)
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import ActorConfig, PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

from packloss import (
    TRUST_REGIONS,
    Component,
    Layout,
    Normalize,
    Outputs,
    Plan,
    Recipe,
    compute_loss,
    count_denominators,
)
from packloss.core.trust_regions import PPOClip
from packloss.integrations.verl import LOSS_AGG_MODES, VERL_VERSION, from_verl, mapping_markdown, rejection_mask
from packloss.testing import OpCounter

F64 = torch.float64
RTOL = 1e-10
EPS = 1e-8  # verl's seq-mean-token-mean: Σ / (n_s + 1e-8)
MODES = [
    "vanilla",
    "gspo",
    "cispo",
    "gpg",
    "sapo",
    "geo_mean",
    "dppo_tv",
    "dppo_kl",
    "dro",
    "bypass:ppo_clip",
    "bypass:reinforce",
]
KL_TYPES = ["low_var_kl", "k1", "k2", "mse", "kl", "k3", "k2+"]
_REGION_OF = {"gpg": "gpg", "sapo": "sapo", "geo_mean": "geo_mean", "dppo_tv": "dppo_tv", "dppo_kl": "dppo_kl"}
_REGION_OF |= {"dro": "gpg", "bypass:reinforce": "gpg"}


def test_installed_verl_is_the_mapped_release():
    assert verl.__version__ == VERL_VERSION


# ---------------------------------------------------------------------------------------------------
# The batch: verl's padded [B, T] fields and the packed streams
# ---------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """A mini-batch. ``valid`` ([B, T]): the response tokens (positions < the row's response length);
    ``mask`` ⊆ ``valid``: verl's response_mask (with holes, and all-zero rows). Padded fields hold
    random finite values past the responses; ``logp``/``entropy`` are packed (the valid tokens)."""

    prompt_lens: list[int]
    resp_lens: list[int]
    mask: Tensor
    old: Tensor
    rollout: Tensor
    ref: Tensor
    adv: Tensor
    logp: Tensor
    entropy: Tensor

    @property
    def num_rows(self) -> int:
        return len(self.resp_lens)

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    @property
    def valid(self) -> Tensor:
        return torch.arange(self.width) < torch.tensor(self.resp_lens)[:, None]

    def packed(self, x: Tensor) -> Tensor:
        return x[self.valid]

    def offsets(self) -> list[int]:
        out = [0]
        for n in self.resp_lens:
            out.append(out[-1] + n)
        return out


def make_batch(seed: int, rows: int = 8, width: int = 12, empty: tuple[int, ...] = (2, 5)) -> Batch:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=g, dtype=F64)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    resp = torch.randint(1, width + 1, (rows,), generator=g)
    resp[0] = width  # the batch's longest response fills the padded width
    prompt = torch.randint(1, 5, (rows,), generator=g)
    valid = torch.arange(width) < resp[:, None]
    mask = valid & (rand(rows, width) > 0.15)
    mask[:, 0] = True  # every row with members has its first token
    mask[0, 1:7] = True
    for r in empty:
        mask[r] = False
    logp = -(rand(rows, width) * 3 + 0.05)
    delta = 0.3 * randn(rows, width)  # ≈ log r = log π_θ − log π_old
    big = rand(rows, width) < 0.05
    delta = torch.where(big, torch.sign(randn(rows, width)) * (1 + rand(rows, width)), delta)
    adv = randn(rows, 1) + 0.3 * randn(rows, width)
    adv = torch.where(rand(rows, width) < 0.05, 0.0, adv)
    # row 0 always holds: A < 0 with r > 3 (dual clip), A > 0 with r > 1.28, A < 0 with r < 0.8, A = 0,
    delta[0, 1:5] = torch.tensor([1.5, 0.5, -0.5, 0.3], dtype=F64)
    adv[0, 1:5] = torch.tensor([-1.0, 1.0, -1.0, 0.0], dtype=F64)
    logp[0, 1:5] = torch.tensor([-2.0, -1.0, -0.1, -0.5], dtype=F64)
    old = -(logp - delta).abs() - 1e-3
    # and p_old = 0.5 → p = 0.8 (A > 0) / 0.2 (A < 0): binary KL 0.223, between clip_ratio_low and _high
    logp[0, 5:7] = torch.tensor([0.8, 0.2], dtype=F64).log()
    old[0, 5:7] = math.log(0.5)
    adv[0, 5:7] = torch.tensor([1.0, -1.0], dtype=F64)
    rollout = -(old + 0.15 * randn(rows, width)).abs() - 1e-3
    ref = (logp + 3 * rand(rows, width) - 1.5).clamp(max=-1e-3)
    entropy = rand(rows, width) * 3
    return Batch(prompt.tolist(), resp.tolist(), mask, old, rollout, ref, adv, logp[valid], entropy[valid])


def leaves(b: Batch) -> tuple[Tensor, Tensor]:
    return b.logp.clone().requires_grad_(True), b.entropy.clone().requires_grad_(True)


# ---------------------------------------------------------------------------------------------------
# verl's side
# ---------------------------------------------------------------------------------------------------


def actor_config(
    mode: str,
    agg: str = "token-mean",
    *,
    kl: str | None = "low_var_kl",
    entropy: float = 0.01,
    rollout: RolloutCorrectionConfig | None = None,
    rows: int = 8,
    scale: int | None = None,
    **fields,
) -> ActorConfig:
    """verl's ActorConfig for ``mode`` (``bypass:<loss_type>`` as verl's ``apply_bypass_mode`` leaves it)."""
    loss_mode = mode
    if mode.startswith("bypass:"):
        loss_mode = "bypass_mode"
        loss_type = mode.split(":")[1]
        rollout = rollout or RolloutCorrectionConfig(bypass_mode=True, loss_type=loss_type, rollout_is=None)
    policy = PolicyLossConfig(
        loss_mode=loss_mode,
        dro_beta=0.3 if mode == "dro" else None,
        rollout_correction=rollout or RolloutCorrectionConfig(rollout_is=None),
    )
    base = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.5)
    return ActorConfig(
        strategy="fsdp",
        rollout_n=2,
        ppo_mini_batch_size=rows // 2,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode=agg,
        loss_scale_factor=scale,
        policy_loss=policy,
        use_kl_loss=kl is not None,
        kl_loss_coef=0.05,
        kl_loss_type=kl or "low_var_kl",
        entropy_coeff=entropy,
        **(base | fields),
    )


def _nested(values: list[Tensor]) -> Tensor:
    lens = torch.tensor([len(v) for v in values])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    return torch.nested.nested_tensor_from_jagged(torch.cat(values), offsets=offsets)


def _pad(x: Tensor, width: int, fill: float = -0.5) -> Tensor:
    return (
        torch.cat([x, torch.full((x.shape[0], width - x.shape[1]), fill, dtype=x.dtype)], 1)
        if width > x.shape[1]
        else x
    )


def verl_micro(
    cfg: ActorConfig,
    b: Batch,
    rows: list[int],
    lp: Tensor,
    ent: Tensor,
    *,
    dp_size: int,
    num_tokens: int,
    global_batch_size: int | None,
    mask: Tensor | None = None,
    old: Tensor | None = None,
    weights: Tensor | None = None,
    width: int | None = None,
) -> Tensor:
    """One call of verl's ``ppo_loss`` on the micro-batch ``rows``, as the engine makes it: the model's
    log-probs over prompt + response (the response's one position to the left, as
    ``no_padding_2_padding`` reads them), the batch fields padded to the batch's response width."""
    width = width or b.width
    mask = b.mask if mask is None else mask
    old = b.old if old is None else old
    off = b.offsets()
    lp_seqs, ent_seqs, prompts, responses = [], [], [], []
    for i in rows:
        p, n = b.prompt_lens[i], b.resp_lens[i]
        zeros = torch.zeros(p - 1, dtype=F64)
        lp_seqs.append(torch.cat([zeros, lp[off[i] : off[i] + n], torch.zeros(1, dtype=F64)]))
        ent_seqs.append(torch.cat([zeros, ent[off[i] : off[i] + n], torch.zeros(1, dtype=F64)]))
        prompts.append(torch.zeros(p, dtype=torch.long))
        responses.append(torch.zeros(n, dtype=torch.long))
    fields = {
        "prompts": _nested(prompts),
        "responses": _nested(responses),
        "response_mask": _pad(mask[rows].to(F64), width, 0.0),
        "old_log_probs": _pad(old[rows], width),
        "advantages": _pad(b.adv[rows], width),
        "ref_log_prob": _pad(b.ref[rows], width),
    }
    if weights is not None:
        fields["rollout_is_weights"] = _pad(weights[rows], width, 0.0)
    data = TensorDict(fields, batch_size=[len(rows)])
    info = dict(dp_size=dp_size, batch_num_tokens=num_tokens, global_batch_size=global_batch_size)
    tu.assign_non_tensor(data, max_response_len=width, **info)
    loss, _ = ppo_loss(cfg, {"log_probs": _nested(lp_seqs), "entropy": _nested(ent_seqs)}, data)
    return loss


def verl_step(cfg, b: Batch, split: list[list[list[int]]], lp, ent, **kw) -> Tensor:
    """verl's step: ``split[rank][micro-batch]`` rows; the engine's global info; the loss whose gradient
    is verl's (``Σ loss / dp_size``: micro-batch gradients add up, FSDP averages the ranks)."""
    mask = kw.pop("mask", b.mask)
    dp = len(split)
    total = 0.0
    for rank in split:
        for rows in rank:
            total = total + verl_micro(
                cfg,
                b,
                rows,
                lp,
                ent,
                dp_size=dp,
                num_tokens=int(mask.sum()),
                global_batch_size=b.num_rows,
                mask=mask,
                **kw,
            )
    return total / dp


# ---------------------------------------------------------------------------------------------------
# packloss's side
# ---------------------------------------------------------------------------------------------------

WeightFn = Callable[[str, "Component", list[int]], Tensor | None]


def packloss_step(
    recipe: Recipe,
    b: Batch,
    split: list[list[list[int]]],
    lp: Tensor,
    ent: Tensor,
    *,
    mask: Tensor | None = None,
    bypass: bool = False,
    weights: WeightFn | None = None,
) -> Tensor:
    """Σ over every micro-batch of every rank of ``compute_loss`` with the step's denominators.
    ``mask`` is packed (default: verl's response mask, packed); ``weights(name, part, rows)`` the
    per-token weights of a part on a micro-batch."""
    mask = b.packed(b.mask) if mask is None else mask
    off = b.offsets()
    streams = {"rollout": b.packed(b.rollout), "old": b.packed(b.old), "ref": b.packed(b.ref), "adv": b.packed(b.adv)}
    plans, slices = [], []
    for rank in split:
        for rows in rank:
            s = slice(off[rows[0]], off[rows[-1] + 1])
            comps = {}
            for name, part in recipe.parts.items():
                w = None if weights is None else weights(name, part, rows)
                comps[name] = Component(part.loss, mask[s], None if w is None else w[s], part.normalize, part.constant)
            plan = Plan(
                [b.resp_lens[i] for i in rows],
                comps,
                inference_logprobs=streams["rollout"][s],
                old_logprobs=None if bypass else streams["old"][s],
                ref_logprobs=streams["ref"][s],
                advantages=streams["adv"][s],
            )
            plans.append(plan)
            slices.append(s)
    den = count_denominators(plans)
    total = 0.0
    for plan, s in zip(plans, slices, strict=True):
        total = total + compute_loss(plan, Outputs(logprobs=lp[s], entropy=ent[s]), den).loss
    return total


def verl_weights(b: Batch, mode: str, mask: Tensor, split: list[list[list[int]]]) -> WeightFn:
    """The documented differences as per-token weights on packloss's parts (module doc):

    * seq-mean modes: verl divides by ``G`` (every row), packloss by ``S_m`` (rows with members):
      ``× S_m / G``;
    * ``geo_mean``'s policy term: verl's mean over the ``b`` rows of each micro-batch call, summed over
      micro-batches, without ``dp_size``: ``× S_m / (b · dp)``.
    """
    off = b.offsets()
    n = torch.tensor([int(mask[off[i] : off[i + 1]].sum()) for i in range(b.num_rows)], dtype=F64)  # [B]
    members = int((n > 0).sum())
    per_token = torch.repeat_interleave(n, torch.tensor(b.resp_lens))  # [N] n_s of each token's row
    dp = len(split)

    def weights(name: str, part, rows: list[int]) -> Tensor | None:
        if name == "pg" and mode == "geo_mean":
            return torch.full_like(per_token, members / (len(rows) * dp))
        if part.normalize is Normalize.SEQUENCE_SUM:
            return torch.full_like(per_token, members / b.num_rows)
        if part.normalize is Normalize.SEQUENCE_MEAN:
            return torch.full_like(per_token, members / b.num_rows)
        return None

    return weights


def assert_close(actual: Tensor, expected: Tensor, what: str, rtol: float = RTOL) -> None:
    """``|actual − expected| ≤ rtol · max|expected|`` (elementwise for gradients), ``expected`` not 0."""
    scale = expected.abs().max()
    assert scale > 0, f"{what}: the reference is zero, the comparison would prove nothing"
    err = (actual - expected).abs().max()
    assert err <= rtol * scale, f"{what}: max error {err:.3e} vs scale {scale:.3e} (rtol {rtol})"


def region_ready(mode: str) -> bool:
    return _REGION_OF.get(mode, "ppo_clip") in TRUST_REGIONS


def compare(cfg, recipe, b: Batch, split, *, mask_packed=None, bypass=False, mode="", verl_kw=None, rtol=RTOL):
    """verl's step vs packloss's (with :func:`verl_weights`): loss and gradients."""
    lp, ent = leaves(b)
    v = verl_step(cfg, b, split, lp, ent, **(verl_kw or {}))
    v_lp, v_ent = torch.autograd.grad(v, [lp, ent])
    mask = b.packed(b.mask) if mask_packed is None else mask_packed
    w = verl_weights(b, mode, mask, split)
    p = packloss_step(recipe, b, split, lp, ent, mask=mask, bypass=bypass, weights=w)
    p_lp, p_ent = torch.autograd.grad(p, [lp, ent])
    assert_close(p.detach(), v.detach(), "loss", rtol)
    assert_close(p_lp, v_lp, "d loss / d log_prob", rtol)
    if cfg.entropy_coeff:
        assert_close(p_ent, v_ent, "d loss / d entropy", rtol)
    return v.detach(), p.detach()


# ---------------------------------------------------------------------------------------------------
# Every mapped loss mode × every loss_agg_mode: one call, and a step over micro-batches and ranks
# ---------------------------------------------------------------------------------------------------


def _case(mode: str, agg: str, rows: int):
    i = MODES.index(mode) + LOSS_AGG_MODES.index(agg)
    cfg = actor_config(mode, agg, kl=KL_TYPES[i % len(KL_TYPES)], rows=rows)
    assert region_ready(mode), f"packloss has no {_REGION_OF[mode]!r} trust region"
    return cfg, from_verl(cfg, response_length=12)


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("mode", MODES)
def test_one_call_matches_verl(mode, agg):
    """One micro-batch on one rank: verl's ``ppo_loss`` (policy loss + KL + entropy) on the padded batch
    vs packloss on the packed one, loss and gradient within 1e-10."""
    cfg, recipe = _case(mode, agg, rows=8)
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
    cfg, recipe = _case(mode, agg, rows=12)
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


def first_epoch(b: Batch, seed: int) -> Batch:
    """``old = log π_θ`` up to a 1e-6 jitter (the first PPO epoch; the jitter gives ``|log r|`` a gradient
    while leaving every covariance ranking as it is)."""
    g = torch.Generator().manual_seed(seed)
    padded = b.old.clone()
    padded[b.valid] = b.logp
    b.old = padded + 1e-6 * torch.randn(padded.shape, generator=g, dtype=F64)
    return b


COV = {
    "clip_cov": dict(clip_cov_ratio=0.5, clip_cov_lb=0.3, clip_cov_ub=2.0),
    "kl_cov": dict(kl_cov_ratio=0.1, ppo_kl_coef=0.7),
}


def _cov_config(mode: str, agg: str, rows: int) -> ActorConfig:
    cfg = actor_config(mode, agg, kl="k2", rows=rows)
    return dataclasses.replace(cfg, policy_loss=dataclasses.replace(cfg.policy_loss, **COV[mode]))


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("mode", ["clip_cov", "kl_cov"])
def test_covariance_modes_match_verl_on_one_micro_batch_first_epoch(mode, agg):
    """Clip-Cov / KL-Cov where verl's choice is packloss's: one micro-batch (its covariance is the
    step's), the first epoch (the live log π is the old one) and, for clip_cov, ``k`` at least the
    band (verl's random draw takes every band token)."""
    if mode not in TRUST_REGIONS:
        with pytest.raises(NotImplementedError, match=f"no '{mode}' trust region"):
            from_verl(_cov_config(mode, agg, 8), response_length=12)
        pytest.fail(f"packloss has no {mode!r} trust region in this checkout")
    cfg = _cov_config(mode, agg, 8)
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
    cfg = _cov_config("kl_cov", "token-mean", 12)
    b = first_epoch(make_batch(45, rows=12, empty=(2, 7)), 2)
    recipe = from_verl(cfg)
    lp, ent = leaves(b)
    whole, split = [[list(range(12))]], [[list(range(6)), list(range(6, 12))]]
    per_micro = torch.autograd.grad(verl_step(cfg, b, split, lp, ent), lp)[0]
    one_call = torch.autograd.grad(verl_step(cfg, b, whole, lp, ent), lp)[0]
    ours_split = torch.autograd.grad(packloss_step(recipe, b, split, lp, ent), lp)[0]
    assert_close(ours_split, one_call, "packloss's split step = verl's whole-batch selection")
    assert (per_micro - one_call).abs().max() > 1e-3 * one_call.abs().max()


# ---------------------------------------------------------------------------------------------------
# Rollout correction
# ---------------------------------------------------------------------------------------------------

IS_SPECS = [("token", 2.0), ("token", "0.5_5.0"), ("sequence", 2.0), ("sequence", "0.5_5.0"), (None, 2.0)]
RS_SPECS = [
    (None, None),
    ("token_k1", "0.8_1.25"),
    ("token_k2", 0.01),
    ("token_k3", 0.01),
    ("seq_sum_k1", "0.6_1.6"),
    ("seq_sum_k2", 0.05),
    ("seq_mean_k3", 0.006),
    ("seq_max_k2", 0.03),
    ("token_k2,seq_sum_k1", "0.01,0.6_1.6"),
]


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


# asymmetric k1 bands: verl keeps log l ≤ −log ρ ≤ log u, i.e. ρ ∈ [1/u, 1/l]
BYPASS_RS = [
    ("token_k1", "0.6_2.5"),
    ("token_k2", 0.05),
    ("token_k3", 0.05),
    ("seq_sum_k1", "0.3_4.0"),
    ("seq_mean_k1", "0.85_1.3"),
]


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
    assert recipe.parts["pg"].loss.correction is None
    b = make_batch(13)
    compare(cfg, recipe, b, [[list(range(8))]], bypass=True, verl_kw={"old": b.rollout})


RS_ALL = {
    "token_k1": "0.7_1.4",
    "token_k2": 0.02,
    "token_k3": 0.02,
    "seq_sum_k1": "0.7_1.4",
    "seq_sum_k2": 0.1,
    "seq_sum_k3": 0.1,
    "seq_mean_k1": "0.95_1.05",
    "seq_mean_k2": 0.01,
    "seq_mean_k3": 0.01,
    "seq_max_k2": 0.05,
    "seq_max_k3": 0.05,
    "token_k1,seq_max_k3": "0.7_1.4,0.05",
}


@pytest.mark.parametrize("rs, threshold", [*RS_ALL.items(), ("seq_sum_k1", 1.5)])
def test_rejection_mask_matches_verl(rs, threshold):
    """``rejection_mask`` on the packed bin is verl's ``compute_rollout_rejection_mask`` on the padded one."""
    b = make_batch(21, rows=16, width=20, empty=(4, 9))
    rc = {"rollout_rs": rs, "rollout_rs_threshold": threshold}
    mask = b.mask.to(torch.long)  # verl's response mask is the attention mask's int64 slice
    expected, _ = compute_rollout_rejection_mask(b.old - b.rollout, mask, rs, threshold)
    ours = rejection_mask(rc, b.packed(b.old), b.packed(b.rollout), b.packed(b.mask), b.resp_lens)
    assert torch.equal(ours, b.packed(expected.bool()))
    assert 0 < int(ours.sum()) < int(b.mask.sum())


def test_rejection_mask_sync_free_flat_and_nan_safe():
    counts = set()
    rc = {"rollout_rs": "token_k1,seq_sum_k2,seq_mean_k3,seq_max_k2", "rollout_rs_threshold": "0.5_2.0,0.1,0.02,0.05"}
    for num_seqs in (1, 16, 256):
        lens = [4] * num_seqs
        g = torch.Generator().manual_seed(num_seqs)
        old, inf = -torch.rand(4 * num_seqs, generator=g), -torch.rand(4 * num_seqs, generator=g)
        mask = torch.rand(4 * num_seqs, generator=g) > 0.2
        old[~mask], inf[~mask] = float("nan"), float("inf")  # non-members never enter
        layout = Layout.build(lens)  # built once per bin, with the plan
        with OpCounter() as counter:
            out = rejection_mask(rc, old, inf, mask, layout)
        assert counter.num_syncs == 0, counter.syncs
        counts.add(counter.total)
        clean = rejection_mask(rc, old.nan_to_num(0.0), inf.clamp(max=0.0), mask, lens)
        assert torch.equal(out, clean) and not bool((out & ~mask).any())
    assert len(counts) == 1, counts


# ---------------------------------------------------------------------------------------------------
# The documented differences, each asserted as a difference
# ---------------------------------------------------------------------------------------------------


def _grads(cfg, recipe, b, *, bypass=False, verl_kw=None, weights=None):
    lp, ent = leaves(b)
    v = verl_step(cfg, b, [[list(range(b.num_rows))]], lp, ent, **(verl_kw or {}))
    p = packloss_step(recipe, b, [[list(range(b.num_rows))]], lp, ent, bypass=bypass, weights=weights)
    return v.detach(), p.detach(), torch.autograd.grad(v, lp)[0], torch.autograd.grad(p, lp)[0]


def _token(b: Batch, row: int, pos: int) -> int:
    return b.offsets()[row] + pos


def test_vanilla_log_ratio_clamp_differs():
    """verl clamps ``log r`` at −20: a token with ``log r = −25`` and ``A > 0`` has verl's gradient 0."""
    b = make_batch(31)
    b.mask[0, 0], b.adv[0, 0] = True, 1.0
    b.logp[_token(b, 0, 0)], b.old[0, 0] = -30.0, -5.0
    cfg = actor_config("vanilla", kl=None, entropy=0.0)
    v, p, gv, gp = _grads(cfg, from_verl(cfg), b)
    t = _token(b, 0, 0)
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
    v, p, gv, gp = _grads(cfg, from_verl(cfg), b)
    row0 = slice(0, b.resp_lens[0])
    assert bool((gv[row0] == 0).all()) and bool((gp[row0][b.mask[0, : b.resp_lens[0]]] != 0).all())
    assert_close(gp[b.resp_lens[0] :], gv[b.resp_lens[0] :], "the other rows")


def test_low_var_kl_clamp_differs():
    """verl clamps ``low_var_kl`` at 10: ``ref − log π = 3`` (k3 ≈ 16.1) has verl's KL gradient 0."""
    b = make_batch(33)
    t = _token(b, 0, 0)
    b.ref[0, 0] = b.logp[t] + 3.0
    cfg = actor_config("vanilla", kl="low_var_kl", entropy=0.0)
    v, p, gv, gp = _grads(cfg, from_verl(cfg), b)
    cfg_no_kl = actor_config("vanilla", kl=None, entropy=0.0)
    _, _, gv_pg, _ = _grads(cfg_no_kl, from_verl(cfg_no_kl), b)
    assert gv[t] == gv_pg[t] and gp[t] != gv[t]  # verl: the policy gradient only


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
    v, p, _, _ = _grads(cfg, recipe, b)
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
    t = _token(b, 0, 1)
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
    v, p, gv, gp = _grads(cfg, from_verl(cfg, rollout_correction=rc), b, verl_kw={"weights": w})
    assert gv[t] != 0 and abs(gp[t] / gv[t] - math.exp(-5.0)) < 1e-6  # e^−25 / e^−20


# ---------------------------------------------------------------------------------------------------
# The mapping itself
# ---------------------------------------------------------------------------------------------------


def _describe(recipe: Recipe) -> list[tuple]:
    return [(name, repr(p.loss), p.normalize, p.constant) for name, p in recipe.parts.items()] + [recipe.notes]


@pytest.mark.parametrize("mode", ["vanilla", "sapo", "dro", "bypass:reinforce"])
def test_dataclass_omegaconf_and_dict_configs_agree(mode):
    if not region_ready(mode):
        pytest.fail("trust region not in this checkout")
    cfg = actor_config(mode, "seq-mean-token-sum-norm", kl="k2", scale=512)
    as_dict = dataclasses.asdict(cfg)
    expected = _describe(from_verl(cfg))
    assert _describe(from_verl(OmegaConf.create(as_dict))) == expected
    assert _describe(from_verl(as_dict)) == expected


def test_verl_default_trainer_config():
    """verl's own generated trainer config (interpolations and all), as a DictConfig and as the
    FSDPActorConfig verl instantiates from it: vanilla PPO clip 0.2, dual clip 3, token-mean."""
    path = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    actor = OmegaConf.load(path).actor_rollout_ref.actor
    actor.ppo_micro_batch_size_per_gpu = 2
    recipe = from_verl(actor)
    assert _describe(from_verl(omega_conf_to_dataclass(actor))) == _describe(recipe)
    pg = recipe.parts["pg"]
    assert list(recipe.parts) == ["pg"] and pg.normalize is Normalize.TOKEN
    assert pg.loss.trust_region == PPOClip(0.2, 0.2, dual_clip_c=3.0) and pg.loss.penalties == ()
    actor.loss_agg_mode = "seq-mean-token-sum-norm"
    with pytest.raises(ValueError, match="response_length"):
        from_verl(actor)
    assert from_verl(actor, response_length=1024).parts["pg"].constant == 256 * 1 * 1024  # mini-batch × n × T


def test_the_recipe_parts():
    cfg = actor_config("vanilla", "seq-mean-token-mean", kl="k1", entropy=0.02)
    recipe = from_verl(cfg)
    assert list(recipe.parts) == ["pg", "entropy"]
    pg = recipe.parts["pg"].loss
    assert (pg.trust_region.clip_low, pg.trust_region.clip_high, pg.trust_region.dual_clip_c) == (0.2, 0.28, 3.0)
    assert (pg.penalties[0].coef, pg.penalties[0].estimator, pg.penalties[0].against) == (0.05, "k1", "ref")
    assert recipe.parts["entropy"].loss.coef == 0.02
    assert {p.normalize for p in recipe.parts.values()} == {Normalize.SEQUENCE_MEAN}
    if region_ready("sapo"):  # sapo's own aggregation moves the KL term into its own part
        sapo = from_verl(actor_config("sapo", "token-mean"))
        assert list(sapo.parts) == ["pg", "kl", "entropy"]
        assert sapo.parts["pg"].normalize is Normalize.SEQUENCE_MEAN and sapo.parts["kl"].normalize is Normalize.TOKEN
    norm = from_verl(actor_config("vanilla", "seq-mean-token-sum-norm", scale=100, rows=8))
    assert norm.parts["pg"].constant == 8 * 100  # ppo_mini_batch_size × rollout_n × loss_scale_factor


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: from_verl(actor_config("vanilla", kl="abs")), NotImplementedError, "kl_loss_type='abs'"),
        (lambda: from_verl(actor_config("vanilla", kl="k3+")), NotImplementedError, "kl_loss_type='k3\\+'"),
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
        (lambda: from_verl({"clip_ratio_c": 1.0}), ValueError, "dual_clip_c must be > 1"),
        (lambda: from_verl(None), TypeError, "actor_config must be"),
        (lambda: from_verl({"kl_loss_coef": "0.1", "use_kl_loss": True}), TypeError, "kl_loss_coef must be a number"),
    ],
)
def test_unmappable_settings_raise_naming_the_option(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_unmapped_corrections_raise():
    with pytest.raises(NotImplementedError, match="rollout_is with loss_mode='dro'"):
        from_verl({"policy_loss": {"loss_mode": "dro", "dro_beta": 0.1}}, rollout_correction={"rollout_is": "token"})
    with pytest.raises(NotImplementedError, match="rollout_is with loss_mode='geo_mean'"):
        from_verl({"policy_loss": {"loss_mode": "geo_mean"}}, rollout_correction={"rollout_is": "sequence"})


def test_docs_table_is_generated_from_the_mapping():
    docs = (Path(__file__).parents[2] / "docs" / "objectives.md").read_text()
    assert "## verl 0.9.1" in docs
    section = docs.split("## verl 0.9.1", 1)[1]
    assert mapping_markdown() in section, "regenerate the table: python -m packloss.integrations.verl"
