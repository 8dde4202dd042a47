"""The README's Python snippets run, in order, as one program."""

from __future__ import annotations

import re

from conftest import ROOT

README = ROOT / "README.md"


def test_readme_snippets_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 3
    namespace: dict = {}
    exec(compile("\n".join(blocks), str(README), "exec"), namespace)
    grad = namespace["trainer"].grad
    assert grad is not None and grad.abs().sum() > 0
    assert set(namespace["metrics"]) >= {"is_masked", "masked_mismatch_kl"}  # the prime-rl snippet's names
    assert set(namespace["result"].metrics) >= {"pg/is_masked", "pg/loss"}
    assert namespace["sft"].loss.requires_grad and namespace["kd"].loss.requires_grad
    assert "pg/rollout_is_masked" in namespace["grpo_result"].metrics
