"""The vocabulary rows of ``packloss bench peers``: a perturbed variant fails the values check, TRL's
fused head agrees with the materialised one, the compiled rows' wiring, rounds of fresh processes merged
per shape, a missing peer skipped with a note, and the head-floor rows do exactly the head's matmul flops."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from packloss.tools.bench import peers_vocab
from packloss.tools.bench._measure import ValuesDisagree
from packloss.vocab import linear_logprobs


@pytest.mark.parametrize("kind", ["head", "distill"])
def test_a_perturbed_fused_variant_fails(monkeypatch, kind):
    name = "head_fn" if kind == "head" else "distill_fn"
    original = getattr(peers_vocab, name)

    def perturbed(variant):
        fn = original(variant)
        return fn if variant == "naive_eager" else (lambda *a: fn(*a) * (1 + 1e-3))

    monkeypatch.setattr(peers_vocab, name, perturbed)
    with pytest.raises(ValuesDisagree, match=f"{kind} packloss_fused value"):
        peers_vocab.check_fused(kind, ["naive_eager", "packloss_fused"], 32, 16, 128, "cpu")


def test_trl_fused_head_agrees_with_the_materialised_head():
    """TRL's own ``ChunkedLogProbFunction`` (installed with the peers) gives the naive head's values and
    gradients; vocab 300 with 128-wide tiles would expose a tile-edge error."""
    errors = peers_vocab.check_fused("head", ["naive_eager", "trl_chunked", "packloss_fused"], 40, 16, 300, "cpu")
    assert set(errors) == {"trl_chunked", "packloss_fused"} and max(errors.values()) < peers_vocab.HEAD_RTOL


def _measured(times: dict[str, float], peak: int = 10):
    """A stand-in for ``run_fresh``: one process's times (its median is ``times[variant]``)."""
    return lambda target, kw: {"times_ms": [times[kw["variant"]]] * 3, "peak_bytes": peak, "value": 0.0}


@pytest.mark.parametrize("compiled", [True, False])
def test_compiled_distill_rows_only_with_compiled_columns_and_every_packloss_row_has_ratios(monkeypatch, compiled):
    """``naive_compiled`` and ``packloss_fused_compiled`` (``impl="compiled"``, Liger's setting) run only
    with compiled columns; each packloss row is divided by each peer row and by the compiled naive row
    (wiring only: agreement and timing are stubbed)."""
    times = {"naive_eager": 8.0, "naive_compiled": 4.0, "packloss_fused": 6.0, "packloss_fused_compiled": 5.0,
             "liger_compiled": 5.5}  # fmt: skip
    monkeypatch.setattr(peers_vocab, "import_peer", lambda module: (object(), None))  # Liger need not be installed
    monkeypatch.setattr(peers_vocab, "check_fused", lambda kind, variants, *a: {v: 0.0 for v in variants[1:]})
    monkeypatch.setattr(peers_vocab, "run_fresh", _measured(times))
    run = peers_vocab.run_fused("distill", [(8, 4, 16)], (8, 4, 16), 1, 1, "cpu", print, [], compiled)
    rows = {r["variant"]: r for r in run}
    ours = ["packloss_fused", "packloss_fused_compiled"] if compiled else ["packloss_fused"]
    naive = ["naive_eager", "naive_compiled"] if compiled else ["naive_eager"]
    assert sorted(rows) == sorted([*naive, "liger_compiled", *ours])
    for variant in ours:
        assert rows[variant]["time_vs_liger_compiled"] == pytest.approx(times[variant] / 5.5)
        assert rows[variant]["time_vs_naive"] == pytest.approx(times[variant] / 8.0)
        if compiled:
            assert rows[variant]["time_vs_naive_compiled"] == pytest.approx(times[variant] / 4.0)


def test_rounds_run_every_variant_in_a_fresh_process_each_round_and_merge_per_shape(monkeypatch):
    """Round-robin over the variants, once per round and shape; a row's time is the median over every
    timed call, its range the fastest and slowest process's median, its peak the largest."""
    calls: list[tuple[str, int]] = []
    per_call = iter([[1.0, 2.0, 3.0], [10.0, 20.0, 30.0], [4.0, 5.0, 6.0], [40.0, 50.0, 60.0]] * 2)

    def fresh(target, kw):
        calls.append((kw["variant"], kw["n"]))
        return {"times_ms": next(per_call), "peak_bytes": len(calls), "value": 0.0}

    monkeypatch.setattr(peers_vocab, "import_peer", lambda module: (None, "absent"))
    monkeypatch.setattr(peers_vocab, "check_fused", lambda kind, variants, *a: {v: 0.0 for v in variants[1:]})
    monkeypatch.setattr(peers_vocab, "run_fresh", fresh)
    shapes = [(8, 4, 16), (16, 4, 16)]
    rows = peers_vocab.run_fused("head", shapes, (8, 4, 16), 3, 2, "cpu", lambda _d: None, [], compiled=False)
    assert calls == [(v, n) for n in (8, 16) for _ in range(2) for v in ("naive_eager", "packloss_fused")]
    first = rows[0]
    assert (first["shape"], first["variant"]) == ("N=8,H=4,V=16", "naive_eager")
    assert (first["time_ms"], first["time_min_ms"], first["time_max_ms"]) == (3.5, 2.0, 5.0)
    assert first["peak_bytes"] == 3 and [r["shape"] for r in rows].count("N=16,H=4,V=16") == 2


class _MatmulFlops(TorchDispatchMode):
    """``2 m k n`` per matrix product (``mm``, ``addmm``, in place or not); every other op but views and
    allocations counted apart."""

    def __init__(self) -> None:
        super().__init__()
        self.flops, self.other = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_"):
            a, b = args[-2], args[-1]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        elif not func.is_view and name not in ("empty", "empty_like"):
            self.other += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("variant, count", [("matmuls_packloss_4", 4), ("matmuls_materialised_3", 3)])
def test_head_floor_does_the_heads_matmul_flops(variant, count):
    """The floor rows do exactly ``count`` ``N × H × V`` matmuls (``2 N H V`` flops each) and no other
    op; ``linear_logprobs``'s forward+backward does the same matmul flops as ``matmuls_packloss_4``.
    V = 2,500 is not a multiple of the CPU block (1,024): a partial block."""
    n, h, v = 300, 16, 2500
    hidden, weight, labels = peers_vocab._head_inputs(n, h, v, "cpu", 0)
    with torch.no_grad(), _MatmulFlops() as floor:
        peers_vocab.head_matmuls(variant)(hidden, weight)
    assert (floor.flops, floor.other) == (count * 2 * n * h * v, 0)
    if count == 4:
        with _MatmulFlops() as head:
            torch.autograd.grad(
                linear_logprobs(hidden, weight, labels, return_entropy=False)[0].sum(), [hidden, weight]
            )
        assert head.flops == floor.flops and head.other > 0


def test_head_floor_rows_are_divided_by_every_head_row(monkeypatch):
    monkeypatch.setattr(peers_vocab, "run_fresh", _measured({"matmuls_packloss_4": 4.0, "matmuls_materialised_3": 3.0}))
    shape = "N=8,H=4,V=16"
    head_rows = [{"variant": "packloss_fused", "time_ms": 5.0, "shape": shape},
                 {"variant": "cce_torch_compile", "time_ms": 4.5, "shape": shape},
                 {"variant": "packloss_fused", "time_ms": 1.0, "shape": "N=9,H=4,V=16"}]  # fmt: skip
    run = peers_vocab.run_head_floors([(8, 4, 16)], 1, 1, "cpu", lambda _d: None, head_rows)
    rows = {r["variant"]: r for r in run}
    assert set(rows) == set(peers_vocab.HEAD_FLOORS)
    assert rows["matmuls_packloss_4"]["time_vs_cce_torch_compile"] == pytest.approx(4.0 / 4.5)
    assert rows["matmuls_materialised_3"]["time_vs_packloss_fused"] == pytest.approx(3.0 / 5.0)
    with pytest.raises(ValueError, match="unknown variant"):
        peers_vocab.head_matmuls("matmuls_5")


def test_a_missing_kernel_peer_is_skipped_with_a_note(monkeypatch):
    for module in ("trl", "trl.kernels", "cut_cross_entropy", "liger_kernel.chunked_loss"):
        monkeypatch.setitem(sys.modules, module, None)  # importing it now raises ImportError
    notes: list[str] = []
    monkeypatch.setattr(peers_vocab, "run_fresh", _measured({"naive_eager": 1.0, "packloss_fused": 1.0}))
    rows = peers_vocab.run_fused("head", [(32, 16, 128)], (32, 16, 128), 1, 1, "cpu", lambda _d: None, notes, False)
    assert [r["variant"] for r in rows] == ["naive_eager", "packloss_fused"]
    assert any(n.startswith("head/cce_torch_compile: cut_cross_entropy not importable") for n in notes), notes
    assert any(n.startswith("head/trl_chunked: trl.kernels not importable") for n in notes), notes
