"""packloss.testing.trl: the duck-typed GRPOConfig, a bare trainer with what TRL 1.16's ``_compute_loss``
reads, the stub forward and the padded inputs, and TRL's own loss run on them."""

from __future__ import annotations

import pytest
import torch

from packloss.integrations.trl import TRL_DEFAULTS
from packloss.testing.trl import GRPO_FIELDS, OneProcess, bare_grpo_trainer, padded_inputs, stub_forward, trl_config


class _Trainer:
    """Stands for ``GRPOTrainer``: the bare trainer is made with ``object.__new__``, never ``__init__``."""

    def __init__(self) -> None:
        raise AssertionError("__init__ must not run")


def test_trl_config_is_trls_defaults_with_the_given_fields_over_them():
    assert vars(trl_config()) == TRL_DEFAULTS | {"steps_per_generation": 1}  # resolved as GRPOConfig does
    assert trl_config(gradient_accumulation_steps=4).steps_per_generation == 4
    assert trl_config(gradient_accumulation_steps=4, steps_per_generation=8).steps_per_generation == 8
    cfg = trl_config(loss_type="grpo", beta=0.04)
    assert (cfg.loss_type, cfg.beta, cfg.epsilon) == ("grpo", 0.04, TRL_DEFAULTS["epsilon"])


def test_a_bare_trainer_carries_what_compute_loss_reads():
    cfg = trl_config(epsilon=0.1, entropy_coef=0.01, gradient_accumulation_steps=4)
    trainer = bare_grpo_trainer(_Trainer, cfg)
    assert type(trainer) is _Trainer and trainer.args is cfg
    assert all(getattr(trainer, name) == getattr(cfg, name) for name in GRPO_FIELDS)
    assert trainer.epsilon_low == trainer.epsilon_high == 0.1  # epsilon_high falls back to epsilon
    assert bare_grpo_trainer(_Trainer, trl_config(epsilon_high=0.28)).epsilon_high == 0.28
    assert trainer._entropy_bonus_enabled and not bare_grpo_trainer(_Trainer, trl_config())._entropy_bonus_enabled
    assert (trainer.aux_loss_enabled, trainer.current_gradient_accumulation_steps, trainer.model.training) == (
        False, 4, True)  # fmt: skip
    assert set(trainer._metrics) == {"train", "eval"} and trainer._metrics["train"]["x"] == []
    x = torch.arange(3.0)
    assert isinstance(trainer.accelerator, OneProcess) and trainer.accelerator.num_processes == 1
    assert trainer.accelerator.gather(x) is x and trainer.accelerator.reduce(x, "mean") is x


def test_the_stub_forward_and_the_padded_inputs():
    trainer = bare_grpo_trainer(_Trainer, trl_config())
    logps, entropies = torch.randn(2, 3), torch.rand(2, 3)
    stub_forward(trainer, logps, entropies)
    got = trainer._get_per_token_logps_and_entropies(None, "ids", "mask", logits_to_keep=3)
    assert got[0] is logps and got[1] is entropies and got[2] is None
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    old = torch.zeros(2, 3)
    inputs = padded_inputs(mask, torch.ones(2, 3, dtype=torch.long), torch.tensor([1.0, -1.0]), torch.tensor(3),
                           old_per_token_logps=old)  # fmt: skip
    assert inputs["prompt_ids"].shape == inputs["prompt_mask"].shape == (2, 0)
    assert inputs["completion_ids"].shape == (2, 3) and inputs["completion_mask"] is mask
    assert inputs["old_per_token_logps"] is old and inputs["num_items_in_batch"].item() == 3


def test_trls_own_loss_runs_on_a_bare_trainer():
    """On-policy (old = the log-probs) DAPO with β = 0: ℓ = −A on every loss token, summed and divided by
    the batch's loss tokens; the gradient reaches the stubbed log-probs."""
    trl = pytest.importorskip("trl")
    # TRL's DAPO divides by num_items_in_batch · accumulation / steps_per_generation (not in TRL_DEFAULTS)
    trainer = bare_grpo_trainer(trl.GRPOTrainer, trl_config(steps_per_generation=1))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    logps = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.3, -9.0]], dtype=torch.float64, requires_grad=True)
    stub_forward(trainer, logps, torch.zeros(2, 3, dtype=torch.float64))
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    inputs = padded_inputs(mask, torch.ones_like(mask), adv, mask.sum(), old_per_token_logps=logps.detach())
    loss = trainer._compute_loss(None, inputs)
    assert loss.item() == pytest.approx(-(3 * 1.0 + 2 * -2.0) / 5, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logps)
    want = torch.tensor([[-1.0, -1.0, -1.0], [2.0, 2.0, 0.0]], dtype=torch.float64) / 5
    assert torch.allclose(grad, want, rtol=1e-12, atol=0)
