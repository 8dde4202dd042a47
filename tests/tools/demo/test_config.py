"""packloss.tools.demo.config: the default run's sizes and schedule, and ``--quick``, which shortens the
schedule and keeps the models."""

from __future__ import annotations

import dataclasses

import pytest

from packloss.tools import demo

SHORTENED = {"bin_tokens": (512, 384), "eval_prompts": (200, 128), "eval_every": (100, 40), "sft_steps": (300, 100),
             "distill_steps": (800, 60), "rl_steps": (60, 15)}  # fmt: skip
"""field → (DEFAULT, QUICK): the fields ``--quick`` changes."""


def test_quick_changes_only_the_schedule():
    for f in dataclasses.fields(demo.DemoConfig):
        default, quick = getattr(demo.DEFAULT, f.name), getattr(demo.QUICK, f.name)
        if f.name in SHORTENED:
            assert (default, quick) == SHORTENED[f.name], f.name
        else:
            assert default == quick, f.name


def test_the_models_and_the_task():
    cfg = demo.DEFAULT
    assert cfg.teacher == demo.ModelSize(hidden=64, layers=2, heads=4, intermediate=256)
    assert cfg.student == demo.ModelSize(hidden=64, layers=2, heads=4, intermediate=128)  # a smaller student
    assert (cfg.min_digits, cfg.max_digits) == (3, 8)
    assert (cfg.rl_prompts, cfg.rl_group) == (16, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rl_steps = 1
