"""The ``trainers`` suite of ``packloss bench`` at its quick shape, each part measured in this process: both
trainers' rows, packloss's values within ``RTOL`` of TRL's (checked inside), its ratios; the values check
refuses values that differ; the suite refuses a GPU and an unknown part (no timing is asserted)."""

from __future__ import annotations

import importlib

import pytest
import torch

from packloss.tools.bench import trainers
from packloss.tools.bench._measure import ValuesDisagree


def _in_process(target: str, kwargs: dict) -> dict:
    """``run_fresh`` without the fresh process: the named function, called here."""
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)(**kwargs)


@pytest.fixture(scope="module")
def quick():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainers, "run_fresh", _in_process)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield trainers.run("cpu", quick=True)
        finally:
            torch.set_num_threads(threads)


def test_rows_of_both_trainers(quick):
    trl, ours = quick["rows"]
    assert (trl["variant"], ours["variant"]) == trainers.VARIANTS
    shape = trainers.SHAPES[True]
    prompts, completions = shape.lengths()
    assert ours["head_positions"] == shape.rows * max(completions)  # the completion positions only
    assert trl["head_positions"] == shape.rows * (max(prompts) + max(completions) - 1)
    for row in (trl, ours):
        assert row["time_ms"] > 0 and row["logprob_ms"] > 0 and row["backbone_ms"] > 0
        assert isinstance(row["peak_bytes"], int) and row["logprob_peak_MiB"] >= 0
    for key in ("step_time_vs_trl", "step_peak_vs_trl", "logprob_time_vs_trl", "logprob_peak_vs_trl"):
        assert ours[key] > 0
    for key, rtol in trainers.RTOL.items():
        assert 0 < ours[f"{key}_rel_err"] <= rtol  # two implementations: float32 rounding, within tolerance
    assert any(note.startswith("acceptance (issue 24)") for note in quick["notes"])


def test_values_that_differ_are_refused():
    g = torch.Generator().manual_seed(0)
    values = {(v, p): {k: torch.randn(6, generator=g) for k in ("logprobs", "entropy", "loss", "update")}
              for v in trainers.VARIANTS for p in trainers.PARTS}  # fmt: skip
    for part in trainers.PARTS:
        values["packloss", part] = values["trl", part]
    assert set(trainers._compare(values)) == {f"{k}_rel_err" for k in trainers.RTOL}
    values["packloss", "step"] = dict(values["trl", "step"], update=values["trl", "step"]["update"] * 1.01)
    with pytest.raises(ValuesDisagree, match="trainers update"):
        trainers._compare(values)


def test_refuses_a_gpu_and_an_unknown_part(tmp_path):
    with pytest.raises(ValueError, match="CPU only"):
        trainers.run("cuda", quick=True)
    shape = trainers.SHAPES[True]
    trainers.save_model(shape, tmp_path / "model")
    with pytest.raises(ValueError, match="part must be one of"):
        trainers.measure("trl", "generation", vars(shape), str(tmp_path / "model"), str(tmp_path / "x.pt"), 1)
