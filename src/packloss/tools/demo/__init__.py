"""``packloss demo``: distil and RL-train a tiny Llama end to end on a verifiable task, packed.

The task (:mod:`~packloss.tools.demo.task`): reverse a string of 3–8 digits. A prompt is
``^ d_1 … d_n :`` and the answer is ``d_n … d_1 $``; the reward is the fraction of the ``n + 1``
answer positions that are right (the ``$`` included), exact match is reported too. Held-out
evaluation prompts never appear in training.

Phases (every loss is :func:`packloss.compute_loss` of a :class:`~packloss.Plan` per packed bin, with
step denominators counted from the plans; see :mod:`~packloss.tools.demo.bins`):

a. **teacher SFT** — ``Component(SFT())`` on the answer tokens;
b. **student on-policy distillation** — the student samples, the teacher scores the sampled tokens,
   ``Component(REF_KL)`` (advantage ``ref − trn``, centred by the step's mean sampled KL: see
   :func:`~packloss.tools.demo.train.train_step`) trains the student; or, with ``--distill full``,
   ``Component(VocabDistill(kind="reverse_kl"))``: the exact full-vocabulary reverse KL on the same
   samples through the fused head, from the student's and the teacher's hidden states;
c. **student RL** — ``G`` samples per prompt, reward, group-normalised advantages
   (:func:`packloss.group_advantages`), ``Component(DPPO)`` with the sampling pass's log-probs as
   inference log-probs.

Sequences are packed into bins of a token budget (``DemoConfig.bin_tokens``,
:func:`packloss.core.packing.pack_ffd`); positions restart at 0 for every sequence, which the Hugging
Face Llama turns into a block-diagonal causal mask (no token attends across sequences). With
``--nproc N`` the step's bins are dealt to ``N`` DDP ranks (gloo on CPU, NCCL on CUDA) and padded with
empty bins (an all-False mask) so every rank runs backward the same number of times; denominators
come from one all-reduce (:func:`packloss.count_denominators`). Sampling is replicated on every rank
(same seed, same weights) — it plays the inference engine, which is outside packloss — so an
``N``-process run trains on exactly the data of a one-process run. ``--emulate-ranks K`` makes one
process accumulate as ``K`` ranks would (same deal of bins, per-rank gradients and sums, combined as
the all-reduces do): for ``K ≤ 2`` its parameters are bit-identical to a ``--nproc K`` run's.

Modules: :mod:`~packloss.tools.demo.task` (task, tokens, reward), :mod:`~packloss.tools.demo.model`
(models, sampling, evaluation, the training forward), :mod:`~packloss.tools.demo.bins` (bins and
plans), :mod:`~packloss.tools.demo.train` (step, phases), :mod:`~packloss.tools.demo.report` (log,
tables, plot, acceptance), :mod:`~packloss.tools.demo.cli` (options, processes, outputs).

Needs the ``hf`` extra (``transformers``); ``rich`` or ``tqdm`` (progress bars) and ``matplotlib``
(the plot) are used when installed.
"""

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
