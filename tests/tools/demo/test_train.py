"""packloss.tools.demo.train: a quick run learns (distillation and RL raise the student's held-out
reward, the KL to the teacher falls); one step of every phase over two gloo ranks equals, bit for bit,
one process accumulating as two ranks (``emulate_ranks=2``).

Cost: one quick single-process run (a module-scoped fixture) and one step of each phase on one process
and on two gloo ranks (see tests/tools/demo/test_cli.py for the two-process run).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

pytest.importorskip("transformers")

from packloss.testing import run_gloo  # noqa: E402
from packloss.tools import demo  # noqa: E402

# `demo --quick` (full-vocabulary distillation), seeds 0-4, 2 CPU cores (docs/demo.md): the student's
# held-out reward gain through distillation 0.454, 0.360, 0.357, 0.349, 0.427 (mean 0.389, std 0.048)
# and through both phases 0.441, 0.408, 0.444, 0.432, 0.387 (mean 0.422, std 0.024); the KL to the
# teacher falls 1.9-2.6x. The untrained student's reward is 0.056-0.073. The margins sit 4 std below
# the means (and well above the untrained reward's range): a run whose distillation stops working fails.
DISTILL_MARGIN = 0.2
MARGIN = 0.3
KL_FALL = 1.5


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("quick")
    assert demo.main(["--quick", "--seed", "0", "--out", str(out), "--progress", "none"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records and (out / "curves.png").stat().st_size > 0
    return json.loads((out / "summary.json").read_text()), torch.load(out / "params.pt")


def test_quick_run_learns(quick):
    summary, _ = quick
    evals = summary["evals"]
    assert summary["distill"] == "full"  # the default
    assert evals["teacher_sft"]["reward"] > evals["teacher_init"]["reward"] + MARGIN
    assert evals["student_distill"]["reward"] - evals["student_init"]["reward"] >= DISTILL_MARGIN
    assert evals["student_rl"]["reward"] - evals["student_init"]["reward"] >= MARGIN
    assert evals["student_distill"]["kl"] * KL_FALL < evals["student_init"]["kl"]


def _one_step_of_each_phase(rank: int, world: int, emulate_ranks: int = 1) -> dict[str, tuple[dict, list[int]]]:
    """One SGD step of every phase kind on fixed data, as rank ``rank`` of ``world`` (DDP when > 1),
    accumulating as ``emulate_ranks`` ranks when ``world`` is 1."""
    ctx = demo.Dist(rank, world, torch.device("cpu"))
    sampler = demo.build_model(demo.QUICK.student, seed=2)
    prompts = demo.Task.make(3, 8, 4, seed=0).sample(random.Random(0), 13)
    gen = torch.Generator().manual_seed(0)
    rollouts = demo.generate(sampler, prompts, 10, generator=gen)
    targets = [demo.target_rollout(d) for d in prompts]
    advantages = torch.randn(len(prompts), generator=gen).tolist()
    out = {}
    for kind in ("ce", "ref_kl", "full", "rl"):
        teacher = demo.build_model(demo.QUICK.teacher, seed=1)
        model = teacher if kind == "ce" else demo.build_model(demo.QUICK.student, seed=2)
        policy = demo.Policy(model)
        policy = DistributedDataParallel(policy) if world > 1 else policy
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
        data = targets if kind == "ce" else rollouts
        ref = None if kind == "ce" else teacher.requires_grad_(False)
        stats = demo.train_step(ctx, policy, optimizer, kind, data, advantages, 64, ref, emulate_ranks=emulate_ranks)
        out[kind] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, stats.empty_bins)
    return out


def test_two_ranks_equal_one_process_per_step():
    """Every phase's step over 2 gloo ranks (DDP, all-reduced denominators, empty bins) equals, bit for
    bit, one process accumulating as two ranks (``emulate_ranks=2``)."""
    single = _one_step_of_each_phase(0, 1, 2)
    ranks = run_gloo(_one_step_of_each_phase, world_size=2, timeout=300)
    initial = {
        "teacher": demo.build_model(demo.QUICK.teacher, seed=1),
        "student": demo.build_model(demo.QUICK.student, seed=2),
    }
    assert any(ranks[0][kind][1] for kind in single), "no rank ran an empty bin"
    for kind, (params, _) in single.items():
        start = initial["teacher" if kind == "ce" else "student"].state_dict()
        moved = max((params[k] - start[k]).abs().max() for k in params)
        assert moved > 1e-3, kind
        for rank in ranks:
            for name, value in params.items():
                assert torch.equal(rank[kind][0][name], value), f"{kind} {name}"
