"""OpenRLHF's own loss module for the tests that compare against it (the policy loss, the value loss,
DPO), by :func:`packloss.testing.openrlhf.load_openrlhf_loss`; without OpenRLHF those tests skip
(``pip install --no-deps openrlhf==0.11.2``)."""

from __future__ import annotations

import pytest

from packloss.integrations.openrlhf import OPENRLHF_VERSION
from packloss.testing.openrlhf import load_openrlhf_loss

__all__ = ["ORL", "needs_openrlhf"]


ORL = load_openrlhf_loss()
needs_openrlhf = pytest.mark.skipif(
    ORL is None, reason=f"OpenRLHF is not installed: pip install --no-deps openrlhf=={OPENRLHF_VERSION}"
)
