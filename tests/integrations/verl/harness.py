"""The verl test harness: padded batches, verl's own loss code on them (one call, a step over
micro-batches and ranks), and packloss's step on the same data."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tensordict import TensorDict
from torch import Tensor
from verl.trainer.config import RolloutCorrectionConfig
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig, PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

from packloss import (
    TRUST_REGIONS,
    Component,
    Normalize,
    Outputs,
    Plan,
    Recipe,
    compute_loss,
    count_denominators,
)
from packloss.integrations.verl import LOSS_AGG_MODES, from_verl

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


KL_TYPES = ["low_var_kl", "k1", "k2", "mse", "kl", "k3", "k2+", "k3+", "k1+", "low_var_kl+"]


REGION_OF = {"gpg": "gpg", "sapo": "sapo", "geo_mean": "geo_mean", "dppo_tv": "dppo_tv", "dppo_kl": "dppo_kl"}


REGION_OF |= {"dro": "gpg", "bypass:reinforce": "gpg"}


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


def nested(values: list[Tensor]) -> Tensor:
    lens = torch.tensor([len(v) for v in values])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    return torch.nested.nested_tensor_from_jagged(torch.cat(values), offsets=offsets)


def pad(x: Tensor, width: int, fill: float = -0.5) -> Tensor:
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
        "prompts": nested(prompts),
        "responses": nested(responses),
        "response_mask": pad(mask[rows].to(F64), width, 0.0),
        "old_log_probs": pad(old[rows], width),
        "advantages": pad(b.adv[rows], width),
        "ref_log_prob": pad(b.ref[rows], width),
    }
    if weights is not None:
        fields["rollout_is_weights"] = pad(weights[rows], width, 0.0)
    data = TensorDict(fields, batch_size=[len(rows)])
    info = dict(dp_size=dp_size, batch_num_tokens=num_tokens, global_batch_size=global_batch_size)
    tu.assign_non_tensor(data, max_response_len=width, **info)
    loss, _ = ppo_loss(cfg, {"log_probs": nested(lp_seqs), "entropy": nested(ent_seqs)}, data)
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
            for name, part in recipe.components.items():
                w = None if weights is None else weights(name, part, rows)
                comps[name] = Component(part.loss, mask[s], None if w is None else w[s], part.normalize, part.constant)
            plan = Plan(
                [b.resp_lens[i] for i in rows],
                comps,
                rollout_logprobs=streams["rollout"][s],
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
    return REGION_OF.get(mode, "ppo_clip") in TRUST_REGIONS


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


def case(mode: str, agg: str, rows: int):
    i = MODES.index(mode) + LOSS_AGG_MODES.index(agg)
    cfg = actor_config(mode, agg, kl=KL_TYPES[i % len(KL_TYPES)], rows=rows)
    assert region_ready(mode), f"packloss has no {REGION_OF[mode]!r} trust region"
    return cfg, from_verl(cfg, response_length=12)


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


def cov_config(mode: str, agg: str, rows: int) -> ActorConfig:
    cfg = actor_config(mode, agg, kl="k2", rows=rows)
    return dataclasses.replace(cfg, policy_loss=dataclasses.replace(cfg.policy_loss, **COV[mode]))


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


# asymmetric k1 bands: verl keeps log l ≤ −log ρ ≤ log u, i.e. ρ ∈ [1/u, 1/l]
BYPASS_RS = [
    ("token_k1", "0.6_2.5"),
    ("token_k2", 0.05),
    ("token_k3", 0.05),
    ("seq_sum_k1", "0.3_4.0"),
    ("seq_mean_k1", "0.85_1.3"),
]


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


def grads(cfg, recipe, b, *, bypass=False, verl_kw=None, weights=None):
    lp, ent = leaves(b)
    v = verl_step(cfg, b, [[list(range(b.num_rows))]], lp, ent, **(verl_kw or {}))
    p = packloss_step(recipe, b, [[list(range(b.num_rows))]], lp, ent, bypass=bypass, weights=weights)
    return v.detach(), p.detach(), torch.autograd.grad(v, lp)[0], torch.autograd.grad(p, lp)[0]


def token(b: Batch, row: int, pos: int) -> int:
    return b.offsets()[row] + pos


def describe(recipe: Recipe) -> list[tuple]:
    return [(name, repr(p.loss), p.normalize, p.constant) for name, p in recipe.components.items()] + [recipe.notes]
