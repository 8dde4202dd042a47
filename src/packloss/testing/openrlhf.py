"""OpenRLHF's own loss module (``openrlhf/models/loss.py``), loaded from the installed package by file
for the equivalence tests and ``packloss bench peers`` (OpenRLHF's full install needs CUDA builds)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path

__all__ = ["load_openrlhf_loss"]


def load_openrlhf_loss() -> types.ModuleType | None:
    """``openrlhf/models/loss.py`` of the installed OpenRLHF, loaded by file path without running
    ``openrlhf.models``'s ``__init__`` (it imports DeepSpeed, flash-attn and peft); its one other import,
    ``models/utils.py``, imports ``deepspeed`` at the top only, answered by an empty stand-in module
    while the file loads when DeepSpeed is not installed. None when OpenRLHF is not installed."""
    try:
        importlib.metadata.version("openrlhf")
    except importlib.metadata.PackageNotFoundError:
        return None
    spec = importlib.util.find_spec("openrlhf")
    models = Path(next(iter(spec.submodule_search_locations))) / "models"
    package = types.ModuleType("_openrlhf_models")
    package.__path__ = [str(models)]
    sys.modules[package.__name__] = package
    stand_in = None
    if "deepspeed" not in sys.modules and importlib.util.find_spec("deepspeed") is None:
        stand_in = sys.modules["deepspeed"] = types.ModuleType("deepspeed")
    try:
        loss_spec = importlib.util.spec_from_file_location(f"{package.__name__}.loss", models / "loss.py")
        module = importlib.util.module_from_spec(loss_spec)
        sys.modules[loss_spec.name] = module
        loss_spec.loader.exec_module(module)
    finally:
        if stand_in is not None and sys.modules.get("deepspeed") is stand_in:
            del sys.modules["deepspeed"]
    return module
