"""The Python snippets of ``docs/context_parallel.md`` run on two gloo ranks and give the gradient of
one process (each snippet's ``step`` returns the step's gradient after the ranks' averaging)."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import ROOT
from packloss.testing.dist import run_gloo

DOC = ROOT / "docs" / "context_parallel.md"


def _program() -> str:
    return "\n".join(re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S))


def _worker(rank: int, world: int, program: str, name: str):
    namespace: dict = {}
    exec(compile(program, str(DOC), "exec"), namespace)
    return namespace[name](rank, world)


@pytest.mark.parametrize("name", ["step", "ring_step"])
def test_context_parallel_snippets_equal_one_process(name):
    program = _program()
    (one,) = run_gloo(_worker, world_size=1, args=(program, name))
    ranks = run_gloo(_worker, world_size=2, args=(program, name))
    assert one.abs().max() > 0
    for grad in ranks:
        torch.testing.assert_close(grad, one, rtol=1e-12, atol=1e-15)
