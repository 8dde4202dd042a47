"""The Python snippets of the docs run: ``docs/context_parallel.md``'s on two gloo ranks give the
gradient of one process (each snippet's ``step`` returns the step's gradient after the ranks'
averaging); ``docs/critic.md``'s PPO step trains both of its components; ``docs/fused_objective.md``'s
one pass gives the head its gradients."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import ROOT
from packloss.testing.dist import run_gloo, run_program

DOC = ROOT / "docs" / "context_parallel.md"
CRITIC = ROOT / "docs" / "critic.md"
FUSED = ROOT / "docs" / "fused_objective.md"


def _program(doc=DOC) -> str:
    return "\n".join(re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S))


@pytest.mark.parametrize("name", ["step", "ring_step"])
def test_context_parallel_snippets_equal_one_process(name):
    program = _program()
    (one,) = run_gloo(run_program, world_size=1, args=(program, name, str(DOC)))
    ranks = run_gloo(run_program, world_size=2, args=(program, name, str(DOC)))
    assert one.abs().max() > 0
    for grad in ranks:
        torch.testing.assert_close(grad, one, rtol=1e-12, atol=1e-15)


def _run_snippets(doc, trained: tuple[str, ...]) -> dict:
    """Run ``doc``'s snippets; each tensor named in ``trained`` got a finite, non-zero gradient."""
    namespace: dict = {}
    exec(compile(_program(doc), str(doc), "exec"), namespace)
    for name in trained:
        grad = namespace[name].grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    return namespace


def test_critic_snippet_trains_the_policy_and_the_critic():
    namespace = _run_snippets(CRITIC, ("logprobs", "values"))
    assert namespace["values"].grad[1] == 0  # the tool's token is no member
    assert set(namespace["critic_metrics"]) == {"critic/loss", "critic/vf_clipfrac", "critic/vpred_mean"}


def test_fused_objective_snippet_takes_the_one_pass():
    namespace = _run_snippets(FUSED, ("hidden", "head"))
    off = ~namespace["completion"]
    assert torch.equal(namespace["hidden"].grad[off], torch.zeros_like(namespace["hidden"].grad[off]))
    assert "rl/loss" in namespace["result"].metrics
