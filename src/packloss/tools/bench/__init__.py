"""Benchmark suites behind ``packloss bench``: ``loss``, ``distill``, ``head`` and ``peers`` (packloss vs TRL, verl,
cut-cross-entropy and Liger where installed).

Each suite module exposes ``run(device: str, quick: bool, progress) -> dict`` returning
``{"rows": [...], ...}`` with every figure; ``packloss.tools.cli`` prints, saves and plots them.
"""
