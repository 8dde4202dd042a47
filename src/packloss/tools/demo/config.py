"""The demo's sizes and schedules: the default run and ``--quick``."""

from __future__ import annotations

from dataclasses import dataclass, replace

from packloss.tools.demo.model import ModelSize

__all__ = ["DemoConfig", "DEFAULT", "QUICK"]


@dataclass(frozen=True)
class DemoConfig:
    teacher: ModelSize = ModelSize(hidden=64, layers=2, heads=4, intermediate=256)
    student: ModelSize = ModelSize(hidden=64, layers=2, heads=4, intermediate=128)
    min_digits: int = 3
    max_digits: int = 8
    eval_prompts: int = 200
    eval_every: int = 100
    bin_tokens: int = 512
    sft_steps: int = 300
    sft_batch: int = 64
    sft_lr: float = 3e-3
    distill_steps: int = 800
    distill_batch: int = 64
    distill_lr: float = 3e-3
    rl_steps: int = 60
    rl_prompts: int = 16
    rl_group: int = 8
    rl_lr: float = 5e-4  # 2e-3 lowered a fully distilled student by up to 0.05 (docs/demo.md)


DEFAULT = DemoConfig()
QUICK = replace(
    DEFAULT,
    bin_tokens=384,  # ~3 bins a step: with --nproc 2 one rank runs an empty bin every step
    eval_prompts=128,
    eval_every=40,
    sft_steps=100,
    distill_steps=60,
    rl_steps=15,
)
