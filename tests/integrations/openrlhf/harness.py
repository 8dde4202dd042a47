"""OpenRLHF's own loss module for the tests that compare against it (the policy loss, the value loss,
DPO), loaded from the installed package by file.

Its ``openrlhf.models`` package imports the whole GPU stack (DeepSpeed, flash-attn, peft). The module's
only other import is ``openrlhf/models/utils.py``, which imports ``deepspeed`` at the top and uses it only
in functions these tests never call: when DeepSpeed is not installed, an empty stand-in module answers
that one import while the files load, and is removed afterwards. Install the package without its
dependencies: ``pip install --no-deps openrlhf==0.11.2``. Without it the tests that call OpenRLHF skip.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path

import pytest

from packloss.integrations.openrlhf import OPENRLHF_VERSION

__all__ = ["ORL", "needs_openrlhf"]


def _load_openrlhf_loss() -> types.ModuleType | None:
    """``openrlhf/models/loss.py`` of the installed OpenRLHF, without running ``openrlhf.models``'s
    ``__init__``; None when OpenRLHF is not installed."""
    try:
        importlib.metadata.version("openrlhf")
    except importlib.metadata.PackageNotFoundError:
        return None
    spec = importlib.util.find_spec("openrlhf")
    models = Path(next(iter(spec.submodule_search_locations))) / "models"
    package = types.ModuleType("_openrlhf_models")
    package.__path__ = [str(models)]
    sys.modules["_openrlhf_models"] = package
    stand_in = None
    if "deepspeed" not in sys.modules and importlib.util.find_spec("deepspeed") is None:
        stand_in = sys.modules["deepspeed"] = types.ModuleType("deepspeed")
    try:
        loss_spec = importlib.util.spec_from_file_location("_openrlhf_models.loss", models / "loss.py")
        module = importlib.util.module_from_spec(loss_spec)
        sys.modules[loss_spec.name] = module
        loss_spec.loader.exec_module(module)
    finally:
        if stand_in is not None and sys.modules.get("deepspeed") is stand_in:
            del sys.modules["deepspeed"]
    return module


ORL = _load_openrlhf_loss()
needs_openrlhf = pytest.mark.skipif(
    ORL is None, reason=f"OpenRLHF is not installed: pip install --no-deps openrlhf=={OPENRLHF_VERSION}"
)
