"""packloss.integrations.prime_rl (prime-rl's loss API after #3418/#3526/#3586) against a per-sequence
reference written here from prime-rl's semantics, in float64.

The reference (:func:`ref_ipo`, :func:`ref_icepop`) is the per-token formula of each loss on one
sequence, with plain autograd and boolean indexing; it runs through
:func:`packloss.testing.reference.compute_loss`, the per-sequence loop of prime-rl's ``compute_loss``
(unchanged since the #2951 era, with ce and ref_kl). Nothing here calls the adapter to build an
expectation. prime-rl itself is not installable here; ``scripts/run_prime_rl_tests.sh`` runs its
own ``test_loss.py`` against this adapter by hand.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace
from typing import Annotated, Any, Literal

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT, bin_of, packings, poison_non_members
from packloss.compat import prime_rl as compat
from packloss.core.pg import PolicyGradient, pg_loss
from packloss.core.trust_regions import IcePop, IcePopLogBand
from packloss.integrations import prime_rl
from packloss.integrations.prime_rl import (
    CustomLossConfig,
    IcePopLoss,
    IcePopLossConfig,
    IPOLoss,
    IPOLossConfig,
    LossInputs,
    compute_loss,
    setup_rl_loss_fn,
)
from packloss.testing import OpCounter, Streams, reference

try:
    import pydantic
    from pydantic import BaseModel, ConfigDict, Field, model_validator
except ImportError:  # pragma: no cover - pydantic ships with the dev environment
    pydantic = None

F64 = torch.float64
RTOL = 1e-12
METRICS = {"masked_mismatch_kl", "unmasked_mismatch_kl", "is_masked"}
needs_pydantic = pytest.mark.skipif(pydantic is None, reason="pydantic is not installed")


# ---------------------------------------------------------------------------------------------------
# The per-sequence reference, from prime-rl's semantics
# ---------------------------------------------------------------------------------------------------


def _mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over ``mask`` (0 when empty), in float64."""
    return values[mask].to(F64).sum() / mask.sum().clamp_min(1)


def _finish(inputs, per_token, keep, dropped, log_r, ratio) -> reference.LossOutputs:
    if inputs.loss_weights is not None:
        per_token = per_token * inputs.loss_weights
    m = inputs.loss_mask
    mismatch_kl = (ratio - log_r - 1).detach()
    metrics = {
        "masked_mismatch_kl": _mean(mismatch_kl, m & dropped),
        "unmasked_mismatch_kl": _mean(mismatch_kl, keep),
        "is_masked": _mean(dropped, m),
    }
    return reference.LossOutputs(loss=per_token.sum(), metrics=metrics)


def ref_ipo(eps: float, adv_tau: float, kl_tau: float):
    """prime-rl's IPO on one sequence: a member is dropped when its probability moved by more than
    ``eps``; ``ℓ = −keep · (adv_tau · A) · r + kl_tau · m · log_r²``, times the weight."""

    def loss(inputs: reference.LossInputs) -> reference.LossOutputs:
        trn, inf, m = inputs.trainer_logprobs, inputs.inference_logprobs, inputs.loss_mask
        log_r = trn - inf
        ratio = torch.exp(log_r)
        dropped = (torch.exp(trn) - torch.exp(inf)).abs() > eps
        keep = m & ~dropped
        per_token = -(keep * (adv_tau * inputs.advantages) * ratio) + kl_tau * (m * log_r**2)
        return _finish(inputs, per_token, keep, dropped, log_r, ratio)

    return loss


def ref_icepop(ratio_low: float, ratio_high: float, adv_tau: float):
    """prime-rl's IcePop on one sequence: keep ``log(ratio_low) ≤ log_r ≤ log(ratio_high)`` (bounds'
    logs in the stream's dtype), ratio replaced by 1 off ``keep`` before ``exp``;
    ``ℓ = −keep · adv_tau · A · r``, times the weight. The mask is multiplied by ``adv_tau`` first, as
    prime-rl does (which rounds ``adv_tau`` to float32: see test_icepop_adv_tau_is_not_rounded)."""

    def loss(inputs: reference.LossInputs) -> reference.LossOutputs:
        trn, inf, m = inputs.trainer_logprobs, inputs.inference_logprobs, inputs.loss_mask
        log_r = trn - inf
        low = torch.tensor(ratio_low, dtype=log_r.dtype).log()
        high = torch.tensor(ratio_high, dtype=log_r.dtype).log()
        dropped = (log_r.detach() < low) | (log_r.detach() > high)
        keep = m & ~dropped
        ratio = torch.exp(torch.where(keep, log_r, torch.zeros_like(log_r)))
        per_token = -(keep * adv_tau * inputs.advantages * ratio)
        return _finish(inputs, per_token, keep, dropped, log_r, torch.exp(log_r))

    return loss


def ref_for(config) -> Any:
    if config.type == "ipo":
        return ref_ipo(config.eps, config.adv_tau, config.kl_tau)
    return ref_icepop(config.ratio_low, config.ratio_high, config.adv_tau)


# ---------------------------------------------------------------------------------------------------
# Test data
# ---------------------------------------------------------------------------------------------------


def make_streams(lens, seed, empty, weighted, ce=False, ref_kl=False, snap=()) -> Streams:
    """A float64 bin: ratios spread over ``[0.08, 12]`` so both losses drop tokens on both sides,
    one advantage per token, ``loss_mask`` with whole sequences empty (``empty``), optional rl / ce /
    ref_kl weights. ``snap`` holds ratios put exactly on some tokens (``inf = 0``, ``trn = log ρ``): an
    IcePop bound lands on the token itself."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    p_inf = torch.rand(n, generator=g, dtype=F64) * 0.9 + 0.05
    log_r = (torch.rand(n, generator=g, dtype=F64) - 0.5) * 5.0
    inf = p_inf.log()
    trn = (inf + log_r).clamp(max=0.0)
    for i, ratio in zip(torch.randperm(n, generator=g).tolist(), snap, strict=False):
        inf[i], trn[i] = 0.0, torch.tensor(ratio, dtype=F64).log()
    seq_ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    mask = (torch.rand(n, generator=g) < 0.8) & ~torch.tensor(empty)[seq_ids]
    rand = lambda: torch.rand(n, generator=g, dtype=F64)  # noqa: E731
    weights = lambda p: (rand() * 2).where(rand() < p, 0.0)  # noqa: E731
    return Streams(
        trainer_logprobs=trn.requires_grad_(),
        inference_logprobs=inf,
        loss_mask=mask,
        seq_lens=tuple(lens),
        advantages=torch.randn(n, generator=g, dtype=F64),
        ref_logprobs=(rand() * 0.9 + 0.05).log() if ref_kl else None,
        rl_weights=weights(0.8) if weighted else None,
        ce_weights=weights(0.5) if ce else None,
        ref_kl_weights=weights(0.5) if ref_kl else None,
    )


def run_both(streams: Streams, config, ref_fn=None):
    """The adapter's ``compute_loss`` and the per-sequence reference's: ``(loss, metrics, grad)`` each."""
    trn = streams.trainer_logprobs
    kwargs = dict(**streams.lists(), **streams.integer_scales())
    loss, metrics = compute_loss(**kwargs, rl_loss_fn=setup_rl_loss_fn(config))
    (grad,) = torch.autograd.grad(loss, trn)
    loss_ref, metrics_ref = reference.compute_loss(**kwargs, rl_loss_fn=ref_fn or ref_for(config))
    (grad_ref,) = torch.autograd.grad(loss_ref, trn)
    return (loss, metrics, grad), (loss_ref, metrics_ref, grad_ref)


def bin_metrics(streams: Streams, ref_fn) -> dict[str, torch.Tensor]:
    """The reference's rl metrics over the whole bin at once: the token-weighted means the adapter
    reports (prime-rl stacks one value per sequence instead)."""
    rl_mask = streams.masks()["rl"]
    whole = reference.LossInputs(
        streams.trainer_logprobs.detach(),
        streams.inference_logprobs,
        streams.ref_logprobs,
        streams.advantages,
        rl_mask,
        streams.rl_weights,
    )
    return ref_fn(whole).metrics


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL) -> None:
    a, e = actual.to(F64).reshape(()), expected.to(F64).reshape(())
    assert abs(a.item() - e.item()) <= rtol * max(1.0, abs(e.item())), (a.item(), e.item())


DYADIC = st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0])  # exact in float32: see ref_icepop


@st.composite
def current_configs(draw):
    """An IPO or IcePop config of the adapter (prime-rl's fields), bounds that fire on make_streams."""
    if draw(st.booleans()):
        eps = draw(st.sampled_from([0.0, 0.05, 0.1, 0.3]) | st.floats(0.0, 0.6))
        kl_tau = draw(st.sampled_from([0.0, 1e-3]) | st.floats(0.0, 0.5))
        return IPOLossConfig(eps=eps, adv_tau=draw(st.floats(0.0, 3.0)), kl_tau=kl_tau)
    low = draw(st.sampled_from([0.2, 0.5]) | st.floats(0.05, 1.0))
    high = draw(st.sampled_from([5.0, 2.0]) | st.floats(low, 8.0))
    return IcePopLossConfig(ratio_low=low, ratio_high=high, adv_tau=draw(DYADIC))


# ---------------------------------------------------------------------------------------------------
# Equivalence with the per-sequence reference
# ---------------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=packings(), config=current_configs(), extra=st.tuples(st.booleans(), st.booleans(), st.booleans()))
def test_current_losses_equal_per_sequence_reference(case, config, extra):
    ce, ref_kl, snap = extra
    bounds = (config.ratio_low, config.ratio_high) * 2 if snap and config.type == "icepop" else ()
    streams = make_streams(*case, ce=ce, ref_kl=ref_kl, snap=bounds)
    (loss, metrics, grad), (loss_ref, _, grad_ref) = run_both(streams, config)
    assert torch.equal(grad, grad_ref), (grad - grad_ref).abs().max()
    assert_close(loss, loss_ref)
    expected = bin_metrics(streams, ref_for(config))
    for key in METRICS:  # packloss reports a fraction (is_masked) in float32
        assert_close(metrics[key], expected[key], rtol=1e-7 if key == "is_masked" else RTOL)
    assert METRICS <= set(metrics) and all(v.shape == (1,) for v in metrics.values())
    assert ("nll" in metrics) == ce and ("ref_kl" in metrics) == ref_kl


@pytest.mark.parametrize("config", [IPOLossConfig(), IcePopLossConfig(), IPOLossConfig(0.05, 1.0, 1e-3)])
def test_trust_regions_fire_on_the_test_data(config):
    """The equivalence test is only meaningful if tokens are dropped and kept (both IcePop sides)."""
    streams = make_streams([40, 1, 23, 60], seed=5, empty=[False, False, True, False], weighted=True)
    (_, metrics, grad), (_, _, grad_ref) = run_both(streams, config)
    assert 0.05 < metrics["is_masked"].item() < 0.95
    assert torch.equal(grad, grad_ref)
    if config.type == "icepop":
        log_r = (streams.trainer_logprobs - streams.inference_logprobs).detach()[streams.masks()["rl"]]
        assert (log_r < math.log(0.2)).any() and (log_r > math.log(5.0)).any()


def test_defaults_are_prime_rls():
    assert (IPOLossConfig().eps, IPOLossConfig().adv_tau, IPOLossConfig().kl_tau) == (0.3, 1.0, 0.0)  # #3586
    assert (IcePopLossConfig().ratio_low, IcePopLossConfig().ratio_high, IcePopLossConfig().adv_tau) == (0.2, 5.0, 1.0)
    assert (IPOLossConfig().type, IcePopLossConfig().type, CustomLossConfig("m.f").type) == ("ipo", "icepop", "custom")
    assert CustomLossConfig("m.f").kwargs == {}
    assert IPOLoss(IPOLossConfig()).objective.penalties == ()  # kl_tau = 0: no drift term at all


def test_kl_tau_zero_equals_no_drift_term_and_positive_kl_tau_changes_the_loss():
    streams = make_streams([30, 30], seed=9, empty=[False, False], weighted=False)
    (loss0, _, grad0), (ref0, _, _) = run_both(streams, IPOLossConfig(0.3, 1.0, 0.0), ref_ipo(0.3, 1.0, 0.0))
    (loss1, _, grad1), (ref1, _, _) = run_both(streams, IPOLossConfig(0.3, 1.0, 1e-3))
    assert_close(loss0, ref0)
    assert_close(loss1, ref1)
    assert not torch.equal(grad0, grad1)


# ---------------------------------------------------------------------------------------------------
# IcePop: prime-rl's own examples and why packloss's IcePop region is not reused
# ---------------------------------------------------------------------------------------------------


def _one_sequence(trn: torch.Tensor) -> LossInputs:
    return LossInputs(trn, torch.zeros_like(trn), None, torch.ones_like(trn), torch.ones_like(trn, dtype=torch.bool))


def test_icepop_band_is_inclusive_in_log_space_in_float32():
    """prime-rl's example: ratios 0.1, 0.2, 1, 5, 10 with the default band keep 0.2, 1 and 5."""
    trn = torch.tensor([0.1, 0.2, 1.0, 5.0, 10.0]).log().requires_grad_()
    result = setup_rl_loss_fn(IcePopLossConfig()).loss(_one_sequence(trn))
    kept = trn.detach().exp()[1:4]
    assert torch.isclose(result.loss, torch.tensor(-6.2))
    assert result.metrics["is_masked"].item() == pytest.approx(0.4)
    result.loss.backward()
    assert torch.equal(trn.grad, -torch.cat([torch.zeros(1), kept, torch.zeros(1)]))
    # packloss's IcePop region compares exp(log r) with the bounds: the float32 ratio read back from
    # log(0.2) lies below 0.2, so it drops that token (is_masked 0.6) where prime-rl keeps it
    band = PolicyGradient(IcePop(0.2, 5.0), ratio="rollout")
    assert pg_loss(_one_sequence(trn.detach()).policy_inputs(), band).metrics["is_masked"].item() == pytest.approx(0.6)


def test_icepop_drops_an_overflowing_ratio_without_nan():
    """A dropped member whose ratio overflows float32 contributes nothing (prime-rl masks before exp);
    its mismatch-KL metric is inf, as prime-rl reports it up to #3586."""
    trn = torch.tensor([100.0, -0.5], requires_grad=True)
    result = IcePopLoss(IcePopLossConfig()).loss(_one_sequence(trn))
    assert torch.equal(result.loss, -torch.exp(trn.detach()[1]))
    result.loss.backward()
    assert torch.equal(trn.grad, torch.stack([torch.tensor(0.0), -torch.exp(trn.detach()[1])]))
    assert result.metrics["is_masked"].item() == 0.5 and math.isinf(result.metrics["masked_mismatch_kl"].item())
    # packloss's IcePop region (it compares exp(log r), not log r) drops the token too, with no NaN
    trn = trn.detach().requires_grad_()
    out = pg_loss(_one_sequence(trn).policy_inputs(), PolicyGradient(IcePop(0.2, 5.0), ratio="rollout"))
    assert torch.equal(out.per_token.sum(), result.loss.detach())
    (grad,) = torch.autograd.grad(out.per_token.sum(), trn)
    assert torch.equal(grad, torch.stack([torch.tensor(0.0), -torch.exp(trn.detach()[1])]))


def test_icepop_allows_a_single_ratio_band():
    """prime-rl accepts ratio_low == ratio_high (only r = ratio_low is kept)."""
    trn = torch.tensor([0.0, -0.1], dtype=F64, requires_grad=True)
    result = setup_rl_loss_fn(IcePopLossConfig(1.0, 1.0)).loss(_one_sequence(trn))
    assert torch.equal(result.loss, torch.tensor(-1.0, dtype=F64))


def test_icepop_adv_tau_is_not_rounded():
    """prime-rl's IcePop multiplies the bool mask by adv_tau first, rounding adv_tau to float32; the
    adapter takes adv_tau · A in the streams' dtype. Equal in float32, apart by that rounding in float64."""
    streams = make_streams([25, 25], seed=2, empty=[False, False], weighted=False)
    config = IcePopLossConfig(adv_tau=0.7)
    (loss, _, _), (loss_ref, _, _) = run_both(streams, config)
    assert loss.item() != loss_ref.item()
    assert_close(loss, loss_ref * 0.7 / torch.tensor(0.7, dtype=torch.float32).item(), rtol=1e-12)
    s32 = streams.replace(
        trainer_logprobs=streams.trainer_logprobs.detach().float().requires_grad_(),
        inference_logprobs=streams.inference_logprobs.float(),
        advantages=streams.advantages.float(),
    )
    (_, _, grad32), (_, _, grad32_ref) = run_both(s32, config)
    assert torch.equal(grad32, grad32_ref)


# ---------------------------------------------------------------------------------------------------
# Configs: duck typing, prime-rl-shaped pydantic models, errors
# ---------------------------------------------------------------------------------------------------


if pydantic is not None:

    class _Base(BaseModel):
        """prime-rl's BaseConfig forbids extra fields."""

        model_config = ConfigDict(extra="forbid")

    class PydIPOLossConfig(_Base):
        type: Literal["ipo"] = "ipo"
        eps: float = Field(0.3, ge=0)
        adv_tau: float = Field(1.0, ge=0)
        kl_tau: float = Field(0.0, ge=0)

    class PydIcePopLossConfig(_Base):
        type: Literal["icepop"] = "icepop"
        ratio_low: float = Field(0.2, gt=0)
        ratio_high: float = Field(5.0, gt=0)
        adv_tau: float = Field(1.0, ge=0)

        @model_validator(mode="after")
        def _bounds(self):
            if self.ratio_low > self.ratio_high:
                raise ValueError("ratio_low must not exceed ratio_high")
            return self

    class PydCustomLossConfig(_Base):
        type: Literal["custom"] = "custom"
        import_path: str
        kwargs: dict[str, Any] = Field(default_factory=dict)

    class PydTrainer(_Base):
        loss: Annotated[PydIPOLossConfig | PydIcePopLossConfig | PydCustomLossConfig, Field(discriminator="type")] = (
            PydIPOLossConfig()
        )

    # the #2951 era, for packloss.compat.prime_rl
    class PydDefaultLossConfig2951(_Base):
        type: Literal["default"] = "default"
        dppo_mask_low: float = Field(0.2, ge=0)
        dppo_mask_high: float = Field(0.2, ge=0)
        adv_tau: float = Field(1.0, ge=0)
        kl_tau: float = Field(1e-3, ge=0)

    class PydIPOLossConfig2951(_Base):
        type: Literal["ipo"] = "ipo"
        ipo_threshold: float = Field(0.1, ge=0)
        adv_tau: float = Field(1.0, ge=0)
        kl_tau: float = Field(1e-3, ge=0)

    class PydCustomLossConfig2951(PydCustomLossConfig):
        pass


@needs_pydantic
@pytest.mark.parametrize(
    "toml, ours",
    [
        ({}, IPOLossConfig()),
        ({"loss": {"type": "ipo", "eps": 0.1, "kl_tau": 1e-3}}, IPOLossConfig(0.1, 1.0, 1e-3)),
        ({"loss": {"type": "icepop"}}, IcePopLossConfig()),
        (
            {"loss": {"type": "icepop", "ratio_low": 0.5, "ratio_high": 2.0, "adv_tau": 2.0}},
            IcePopLossConfig(0.5, 2.0, 2.0),
        ),
    ],
)
def test_prime_rl_shaped_pydantic_configs_are_accepted(toml, ours):
    """``[trainer.loss]`` parsed into pydantic models of prime-rl's shape (another class than ours)."""
    config = PydTrainer.model_validate(toml).loss
    assert not isinstance(config, type(ours))
    streams = make_streams([20, 7, 33], seed=4, empty=[False, False, False], weighted=True)
    (loss, metrics, grad), (loss_ref, _, grad_ref) = run_both(streams, config, ref_for(ours))
    (loss_ours, metrics_ours, grad_ours), _ = run_both(streams, ours)
    assert torch.equal(grad, grad_ref) and torch.equal(grad, grad_ours)
    assert torch.equal(loss, loss_ours) and metrics.keys() == metrics_ours.keys()
    assert_close(loss, loss_ref)


@needs_pydantic
def test_prime_rl_shaped_pydantic_custom_config():
    config = PydTrainer.model_validate(
        {"loss": {"type": "custom", "import_path": "custom_losses.additive_loss", "kwargs": {"coef": 0.5}}}
    ).loss
    loss_obj = setup_rl_loss_fn(config)
    assert isinstance(loss_obj, prime_rl.CustomLoss) and loss_obj.kwargs == {"coef": 0.5}
    streams = bin_of("weighted_grpo", seed=1)
    kwargs = dict(**streams.lists(), **streams.integer_scales())
    loss, metrics = compute_loss(**kwargs, rl_loss_fn=loss_obj)
    loss_ref, _ = reference.compute_loss(**kwargs, rl_loss_fn=reference.setup_rl_loss_fn(config))
    assert torch.equal(*(torch.autograd.grad(x, streams.trainer_logprobs)[0] for x in (loss, loss_ref)))
    assert "custom_ratio" in metrics


@needs_pydantic
@pytest.mark.parametrize(
    "config, ours",
    [
        ("PydDefaultLossConfig2951", compat.DefaultLossConfig()),
        ("PydIPOLossConfig2951", compat.IPOLossConfig()),
        ("PydCustomLossConfig2951", compat.CustomLossConfig("custom_losses.additive_loss", {"coef": 0.5})),
    ],
)
def test_compat_accepts_2951_era_pydantic_look_alikes(config, ours):
    """packloss.compat.prime_rl matches #2951-era configs by their fields: a pydantic look-alike
    (another class, same field names, a ``type`` discriminator) gives the reference's loss."""
    fields = {"import_path": ours.import_path, "kwargs": ours.kwargs} if config.startswith("PydCustom") else {}
    foreign = globals()[config](**fields)
    streams = bin_of("weighted_grpo", seed=2)
    kwargs = dict(**streams.lists(), **streams.integer_scales())
    loss, _ = compat.compute_loss(**kwargs, rl_loss_fn=compat.setup_rl_loss_fn(foreign))
    loss_ref, _ = reference.compute_loss(**kwargs, rl_loss_fn=reference.setup_rl_loss_fn(ours))
    grads = [torch.autograd.grad(x, streams.trainer_logprobs)[0] for x in (loss, loss_ref)]
    assert torch.equal(*grads)
    assert torch.allclose(loss, loss_ref, rtol=1e-6, atol=1e-7)


@needs_pydantic
@pytest.mark.parametrize(
    "config, match",
    [
        ("PydDefaultLossConfig2951", "#3418"),
        ("PydIPOLossConfig2951", "ipo_threshold"),
    ],
)
def test_2951_era_configs_are_rejected_by_the_current_adapter(config, match):
    with pytest.raises(ValueError, match=match):
        setup_rl_loss_fn(globals()[config]())


def test_plain_objects_are_matched_by_type_and_fields():
    """Any object with prime-rl's fields works; a missing field takes prime-rl's default."""
    loss_obj = setup_rl_loss_fn(SimpleNamespace(type="icepop", ratio_low=0.5))
    assert isinstance(loss_obj, IcePopLoss) and loss_obj.objective.trust_region == IcePopLogBand(0.5, 5.0)
    ipo = setup_rl_loss_fn(SimpleNamespace(type="ipo"))
    assert ipo.objective.trust_region.threshold == 0.3 and ipo.objective.penalties == ()


def test_loss_objects_follow_the_protocol():
    """``.loss(inputs)``, no ``__call__`` (prime-rl's Loss protocol); compute_loss calls ``.loss``."""
    for config in (IPOLossConfig(), IcePopLossConfig(), CustomLossConfig("custom_losses.additive_loss")):
        loss_obj = setup_rl_loss_fn(config)
        assert callable(loss_obj.loss) and not callable(loss_obj)
    streams = bin_of("hot", seed=1)
    with pytest.raises(TypeError, match="rl_loss_fn must be a Loss"):
        compute_loss(
            **streams.lists(), **streams.integer_scales(), rl_loss_fn=compat.setup_rl_loss_fn(compat.IPOLossConfig())
        )


def test_loss_accepts_a_foreign_inputs_object():
    """prime-rl's own LossInputs (any object with its fields) is one sequence."""
    trn = torch.tensor([-0.3, -1.2, -0.1], dtype=F64, requires_grad=True)
    fields = dict(
        trainer_logprobs=trn,
        inference_logprobs=torch.tensor([-0.4, -0.2, -0.1], dtype=F64),
        ref_logprobs=None,
        advantages=torch.tensor([1.0, -1.0, 0.5], dtype=F64),
        loss_mask=torch.tensor([True, True, False]),
    )
    loss_obj = setup_rl_loss_fn(IPOLossConfig(eps=0.3, kl_tau=1e-3))
    ours = loss_obj.loss(LossInputs(**fields))
    foreign = loss_obj.loss(SimpleNamespace(**fields))
    expected = ref_ipo(0.3, 1.0, 1e-3)(reference.LossInputs(**fields))
    assert torch.equal(ours.loss, foreign.loss)
    assert_close(ours.loss, expected.loss)
    with pytest.raises(TypeError, match="without"):
        loss_obj.loss(SimpleNamespace(trainer_logprobs=trn))


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: IPOLossConfig(eps=-0.1), ValueError, r"IPOLossConfig\.eps must be >= 0"),
        (lambda: IPOLossConfig(eps=float("nan")), ValueError, r"IPOLossConfig\.eps must be finite"),
        (lambda: IPOLossConfig(kl_tau=True), TypeError, r"IPOLossConfig\.kl_tau must be a number"),
        (lambda: IPOLossConfig(adv_tau=-1.0), ValueError, r"IPOLossConfig\.adv_tau must be >= 0"),
        (lambda: IcePopLossConfig(ratio_low=0.0), ValueError, r"IcePopLossConfig\.ratio_low must be > 0"),
        (lambda: IcePopLossConfig(2.0, 1.0), ValueError, "ratio_low must not exceed ratio_high"),
        (lambda: IcePopLossConfig(adv_tau=float("inf")), ValueError, r"IcePopLossConfig\.adv_tau must be finite"),
        (lambda: IcePopLossConfig(ratio_high="5"), TypeError, r"IcePopLossConfig\.ratio_high must be a number"),
        (lambda: IcePopLogBand(0.0, 1.0), ValueError, "0 < ratio_low <= ratio_high"),
        (lambda: IPOLossConfig(type="icepop"), ValueError, "IPOLossConfig.type must be 'ipo'"),
        (lambda: CustomLossConfig(3), TypeError, r"CustomLossConfig\.import_path must be a str"),
        (lambda: setup_rl_loss_fn({"type": "ipo"}), TypeError, "loss_config must be a prime-rl loss config"),
        (lambda: setup_rl_loss_fn(SimpleNamespace(type="default")), ValueError, "removed from prime-rl in #3418"),
        (lambda: setup_rl_loss_fn(SimpleNamespace(type="ppo")), ValueError, "loss_config.type must be one of"),
        (lambda: setup_rl_loss_fn(SimpleNamespace(type="ipo", ipo_threshold=0.1)), ValueError, "ipo_threshold"),
        (
            lambda: setup_rl_loss_fn(SimpleNamespace(type="ipo", eps=0.3, max_importance_ratio=1e4)),
            ValueError,
            "max_importance_ratio",
        ),
        (lambda: setup_rl_loss_fn(SimpleNamespace(type="icepop", eps=0.3)), ValueError, r"fields \['eps'\]"),
        (lambda: setup_rl_loss_fn(CustomLossConfig("custom_losses.missing")), ValueError, "cannot import"),
        (lambda: setup_rl_loss_fn(CustomLossConfig("custom_losses.additive_loss", [1])), TypeError, "kwargs must"),
    ],
)
def test_bad_configs_name_the_field(build, error, match):
    with pytest.raises(error, match=match):
        build()


# ---------------------------------------------------------------------------------------------------
# Packed-engine properties: NaN-safe non-members, sync-free, flat in the number of sequences
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [IPOLossConfig(0.1, 1.0, 1e-3), IcePopLossConfig()])
def test_non_members_may_hold_anything(config):
    clean = bin_of("weighted_grpo", seed=7)
    poisoned, _, _ = poison_non_members(clean)
    fn = setup_rl_loss_fn(config)
    results = []
    for streams in (clean, poisoned):
        loss, metrics = compute_loss(**streams.lists(), **streams.integer_scales(), rl_loss_fn=fn)
        (grad,) = torch.autograd.grad(loss, streams.trainer_logprobs)
        results.append((loss, metrics, grad))
    (loss_c, metrics_c, grad_c), (loss_p, metrics_p, grad_p) = results
    assert torch.isfinite(loss_p) and torch.isfinite(grad_p).all()
    assert torch.equal(loss_c, loss_p) and torch.equal(grad_c, grad_p)
    assert all(torch.equal(metrics_c[k], metrics_p[k]) for k in metrics_c)


_METADATA_OPS = {"aten.view", "aten.expand", "aten.as_strided", "aten.alias", "aten.slice", "aten.narrow"}


@pytest.mark.parametrize("config", [IPOLossConfig(0.1, 1.0, 1e-3), IcePopLossConfig()])
def test_sync_free_and_flat_in_the_number_of_sequences(config):
    fn = setup_rl_loss_fn(config)
    totals = {}
    for num_seqs in (1, 16, 256):
        streams = bin_of("echo", num_tokens=1024, num_seqs=num_seqs, seed=3)
        kwargs = dict(**streams.lists(), **streams.integer_scales())
        with OpCounter() as counter:
            loss, _ = compute_loss(**kwargs, rl_loss_fn=fn)
            loss.backward()
        assert counter.num_syncs == 0, counter.syncs
        totals[num_seqs] = sum(n for op, n in counter.ops.items() if op not in _METADATA_OPS)
    assert totals[1] == totals[16] == totals[256], totals


# ---------------------------------------------------------------------------------------------------
# The documentation's snippet
# ---------------------------------------------------------------------------------------------------


def test_doc_snippet_runs():
    doc = ROOT / "docs" / "integrations" / "prime_rl.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    assert blocks
    namespace: dict = {}
    exec(compile("\n".join(blocks), str(doc), "exec"), namespace)
    assert namespace["trainer_logprobs"].grad.abs().sum() > 0
    assert set(namespace["metrics"]) >= METRICS


# ---------------------------------------------------------------------------------------------------
# scripts/run_prime_rl_tests.sh (the manual run of prime-rl's own tests), on a test file written here
# ---------------------------------------------------------------------------------------------------

_PRIME_RL_STYLE_TESTS = """
import pytest
import torch

from prime_rl.configs.trainer import IcePopLossConfig, PPOLossConfig
from prime_rl.trainer.rl.loss import (
    LossInputs,
    LossOutputs,
    setup_rl_loss_fn,
)

pytestmark = [pytest.mark.gpu]


def test_icepop_on_the_device():
    trn = torch.tensor([0.2, 10.0], device="cuda").log()
    inputs = LossInputs(trn, torch.zeros(2).cuda(), None, torch.ones(2).cuda(), torch.ones(2, dtype=torch.bool).cuda())
    assert torch.isclose(setup_rl_loss_fn(IcePopLossConfig()).loss(inputs).loss, torch.tensor(-0.2, device="cuda"))


@pytest.mark.parametrize("config", [PPOLossConfig()])
def test_a_loss_packloss_lacks(config):
    setup_rl_loss_fn(config)


def test_custom_loss_by_import_path():
    config = type(IcePopLossConfig())  # a name that exists
    from packloss.integrations.prime_rl import CustomLossConfig

    loss = setup_rl_loss_fn(CustomLossConfig("tests.unit.train.rl.test_loss._custom", {"k": 2.0}))
    inputs = LossInputs(torch.ones(3), torch.ones(3), None, torch.ones(3), torch.ones(3, dtype=torch.bool))
    assert loss.loss(inputs).loss.item() == 6.0 and config is not None


def _custom(inputs, k):
    return LossOutputs(loss=(inputs.trainer_logprobs * k).sum(), metrics={})
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_run_prime_rl_tests_script(tmp_path):
    """The script rewrites prime-rl's imports, skips tests that need a name packloss lacks, runs
    ``.cuda()`` tests on the CPU and keeps custom import paths under ``tests.unit.train.rl.test_loss``."""
    source = tmp_path / "test_loss.py"
    source.write_text(_PRIME_RL_STYLE_TESTS)
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run_prime_rl_tests.sh"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "names it does not define: ['PPOLossConfig']" in run.stdout
    assert "2 passed, 1 skipped" in run.stdout, run.stdout
    assert "PPOLossConfig is not defined by packloss.integrations.prime_rl" in run.stdout
