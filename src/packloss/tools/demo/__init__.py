"""``packloss demo``: SFT a tiny Llama teacher on digit reversal, distil it into a student on the
student's own samples, then improve the student with RL, every loss a packed-bin ``compute_loss`` with
step denominators, optionally over ``--nproc`` DDP ranks. Needs the ``hf`` extra. How it works and
what a run shows: ``docs/demo.md``."""

from packloss.tools.demo.bins import COMPONENT, KINDS, Bin, empty_bin, make_bin, make_plan, teacher_streams
from packloss.tools.demo.cli import add_arguments, main, run
from packloss.tools.demo.config import DEFAULT, QUICK, DemoConfig
from packloss.tools.demo.model import (
    ModelSize,
    Policy,
    Rollout,
    build_model,
    evaluate,
    generate,
    packed_hidden,
    packed_logprobs,
    target_rollout,
)
from packloss.tools.demo.report import acceptance, format_table, plot_curves
from packloss.tools.demo.task import Task, decode, encode_prompt, encode_target, score
from packloss.tools.demo.train import Dist, StepStats, run_phases, train_step

__all__ = [
    "DemoConfig",
    "DEFAULT",
    "QUICK",
    "ModelSize",
    "Rollout",
    "Task",
    "Bin",
    "Dist",
    "Policy",
    "StepStats",
    "KINDS",
    "COMPONENT",
    "add_arguments",
    "acceptance",
    "build_model",
    "decode",
    "empty_bin",
    "encode_prompt",
    "encode_target",
    "evaluate",
    "format_table",
    "generate",
    "main",
    "make_bin",
    "make_plan",
    "packed_hidden",
    "packed_logprobs",
    "plot_curves",
    "run",
    "run_phases",
    "score",
    "target_rollout",
    "teacher_streams",
    "train_step",
]
