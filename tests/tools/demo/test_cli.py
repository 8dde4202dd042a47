"""packloss.tools.demo.cli: ``--quick --nproc 2`` ends with the parameters, bit for bit, of the
one-process ``--quick --emulate-ranks 2`` run; the schedule options; usage errors before any run.

Cost: two quick runs (a plain two-process run and ``--emulate-ranks 2``, module-scoped fixtures).
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from packloss.tools import demo
from packloss.tools.demo import cli


def _quick_run(out, *extra: str) -> tuple[dict, dict]:
    assert demo.main(["--quick", "--seed", "0", "--out", str(out), "--progress", "none", *extra]) == 0
    return json.loads((out / "summary.json").read_text()), torch.load(out / "params.pt")


@pytest.fixture(scope="module")
def quick_two_ranks(tmp_path_factory) -> tuple[dict, dict]:
    pytest.importorskip("transformers")
    return _quick_run(tmp_path_factory.mktemp("quick2"), "--nproc", "2")


@pytest.fixture(scope="module")
def quick_emulated(tmp_path_factory) -> tuple[dict, dict]:
    pytest.importorskip("transformers")
    return _quick_run(tmp_path_factory.mktemp("quick_emulated"), "--emulate-ranks", "2")


def test_two_process_quick_run(quick_two_ranks, quick_emulated):
    """``--quick --nproc 2`` finishes, runs empty bins, and ends with the parameters, bit for bit, of
    the one-process ``--quick --emulate-ranks 2`` run over the same data.

    One process accumulates each rank's bins into its own gradient, in the rank's order, and adds the
    two as the all-reduce does (a sum of two floats does not depend on gloo's order); the step mean
    of the sampled KL is summed per rank and then across the same way; the denominators are integer
    counts. Identical weights then sample identical data, step after step. A plain one-process run
    sums the bins in another order and drifts (measured: 0.003 teacher, 0.14 student at the end).
    """
    summary, params = quick_two_ranks
    assert summary["nproc"] == 2
    empty = [n for p in summary["phases"].values() for n in p["empty_bins"].values()]
    assert sum(empty) > 0, "no rank ran an empty bin: the equalisation path was not exercised"
    reference, reference_params = quick_emulated
    assert reference["nproc"] == 1 and reference["emulate_ranks"] == 2
    assert reference["phases"]["sft"]["empty_bins"] == summary["phases"]["sft"]["empty_bins"]
    for model in ("teacher", "student"):
        assert params[model].keys() == reference_params[model].keys()
        for name, value in params[model].items():
            torch.testing.assert_close(value, reference_params[model][name], rtol=0, atol=0, msg=f"{model} {name}")
    for name, e in summary["evals"].items():
        assert e == reference["evals"][name], name


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_schedule_is_quick_or_default_with_the_step_overrides():
    assert cli._config(_args()) == demo.DEFAULT
    assert cli._config(_args("--quick")) == demo.QUICK
    cfg = cli._config(_args("--quick", "--rl-steps", "3", "--sft-steps", "2"))
    assert (cfg.rl_steps, cfg.sft_steps, cfg.distill_steps) == (3, 2, demo.QUICK.distill_steps)
    assert cfg.bin_tokens == demo.QUICK.bin_tokens
    args = _args()
    assert (args.nproc, args.emulate_ranks, args.threads, args.distill, args.baseline) == (1, 1, 1, "full", True)


def test_emulated_ranks_are_for_one_process_only(capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the demo ran despite a usage error")

    monkeypatch.setattr(cli, "_worker", refuse)
    assert demo.main(["--quick", "--nproc", "2", "--emulate-ranks", "2", "--progress", "none"]) == 2
    assert (
        capsys.readouterr().err == "packloss demo: error: --emulate-ranks is for one process (it emulates --nproc K)\n"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_usage_error(capsys):
    assert demo.main(["--quick", "--device", "cuda", "--progress", "none"]) == 2
    assert "--device cuda needs 1 GPU(s), found 0" in capsys.readouterr().err
