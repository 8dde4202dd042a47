"""packloss.testing.openrlhf: OpenRLHF's loss module loads by file, without its GPU stack."""

from __future__ import annotations

import sys

from packloss.testing.openrlhf import load_openrlhf_loss


def test_loads_openrlhfs_loss_module_without_deepspeed_left_behind():
    module = load_openrlhf_loss()
    assert module is not None, "OpenRLHF is installed in CI (pip install --no-deps openrlhf==0.11.2)"
    assert all(hasattr(module, name) for name in ("PolicyLoss", "ValueLoss", "DPOLoss"))
    assert "deepspeed" not in sys.modules or sys.modules["deepspeed"].__spec__ is not None
