"""``packloss bench peers`` on tiny sizes: the tables and ``results.json``, the values check that precedes
every timing (and fails on a perturbed peer or packloss variant), and a missing peer skipped with a note.
No timing is asserted."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from packloss.tools.bench import peers, report
from packloss.tools.cli import run_suite

TINY = peers.Sizes(
    rl_tokens=96,
    rl_seqs=5,
    compiled=False,
    rl_warmup=1,
    rl_repeat=2,
    fused=(32, 16, 128),
    fused_check=(32, 16, 128),
    fused_repeat=1,
)
RL_COMPARISONS = ("rl/dapo·trl", "rl/ppo_clip·verl", "rl/dppo_tv·verl")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One ``run_suite("peers", quick=True)`` at :data:`TINY` (the CLI's path to a suite), its tables and JSON."""
    mp = pytest.MonkeyPatch()
    mp.setattr(peers, "sizes", lambda quick: TINY)
    try:
        result = run_suite("peers", "cpu", True, lambda _d: None, use_compile=True)
    finally:
        mp.undo()
    out = io.StringIO()
    report.print_tables({"peers": result}, out)
    path = tmp_path_factory.mktemp("peers") / "results.json"
    report.write_json(path, {"suites": {"peers": result}})
    return result, out.getvalue(), json.loads(path.read_text())


def _rows(result: dict, comparison: str) -> dict[str, dict]:
    return {r["variant"]: r for r in result["rows"] if r["comparison"] == comparison}


def test_tiny_run_has_a_checked_row_per_variant_and_ratios(tiny_run):
    result, _, _ = tiny_run
    assert "error" not in result, result.get("traceback")
    for comparison in RL_COMPARISONS:  # trl and verl are installed in the test environment
        rows = _rows(result, comparison)
        peer = comparison.split("·")[1]
        assert set(rows) == {"packloss_eager", peer}
        ours = rows["packloss_eager"]
        assert 0 <= ours["grad_rel_err"] <= peers.RL_RTOL and ours["loss_rel_diff"] >= 0
        assert ours[f"vs_{peer}"] == pytest.approx(ours["time_ms"] / rows[peer]["time_ms"])
    for kind in ("head", "distill"):
        rows = _rows(result, kind)
        assert {"naive_eager", "packloss_fused"} <= set(rows)
        for variant, row in rows.items():
            assert row["time_ms"] > 0 and row["peak_bytes"] is not None
            assert row["value"] == pytest.approx(rows["naive_eager"]["value"], rel=1e-4)
            if variant != "naive_eager":
                assert row["max_rel_err"] <= peers.HEAD_RTOL


def test_one_table_per_comparison_and_json(tiny_run):
    result, text, payload = tiny_run
    for comparison in (*RL_COMPARISONS, "head", "head floor", "distill"):
        assert f"packloss bench peers: {comparison}" in text
    assert payload["suites"]["peers"]["rows"] == json.loads(json.dumps(result["rows"]))
    for note in result["notes"]:  # cut-cross-entropy / Liger when not installed
        assert f"note: {note}" in text


def test_check_fails_on_a_difference_a_zero_reference_and_nan():
    x = torch.tensor([1.0, -2.0])
    assert peers.check("x", x * (1 + 1e-7), x, 1e-6) <= 1e-6
    with pytest.raises(peers.ValuesDisagree, match="x: max error"):
        peers.check("x", x * (1 + 1e-5), x, 1e-6)
    with pytest.raises(peers.ValuesDisagree):
        peers.check("zero", torch.zeros(2), torch.zeros(2), 1e-6)
    with pytest.raises(peers.ValuesDisagree):
        peers.check("nan", torch.tensor([1.0, float("nan")]), x, 1e-6)


def _scaled(original):
    return lambda *a: original(*a) * (1 + 1e-4)  # loss and gradient off by 1e-4


def _shifted(original):
    return lambda *a: original(*a) + 1e-7  # the loss alone, by ~1e-4 of its value


def _bent(original):
    def bent(*a):  # the loss alone right, the gradient at one token off by 1e-3
        *head, logp = a
        w = torch.ones_like(logp)
        w[0, 0] = 1.001
        return original(*head, logp + (logp * w - (logp * w).detach()) - (logp - logp.detach()))

    return bent


@pytest.mark.parametrize(("target", "perturb", "match"), [
    ("_trl_loss", _scaled, "float64"),
    ("_verl_loss", _scaled, "float64"),
    ("_trl_loss", _shifted, "float64. loss"),
    ("_verl_loss", _shifted, "float64. loss"),
    ("_trl_loss", _bent, "gradient"),
    ("_verl_loss", _bent, "gradient"),
])  # fmt: skip
def test_a_perturbed_rl_peer_fails_before_timing(monkeypatch, target, perturb, match):
    monkeypatch.setattr(peers, target, perturb(getattr(peers, target)))
    if target == "_verl_loss":
        monkeypatch.setitem(sys.modules, "trl", None)  # TRL's comparison (unperturbed, timed) comes first
    monkeypatch.setattr(peers, "_interleaved_ms", lambda *a: pytest.fail("timed despite different values"))
    with pytest.raises(peers.ValuesDisagree, match=match):
        peers.run_rl(96, 5, False, 1, 1, lambda _d: None, [])


@pytest.mark.parametrize("kind", ["head", "distill"])
def test_a_perturbed_fused_variant_fails(monkeypatch, kind):
    name = "head_fn" if kind == "head" else "distill_fn"
    original = getattr(peers, name)

    def perturbed(variant):
        fn = original(variant)
        return fn if variant == "naive_eager" else (lambda *a: fn(*a) * (1 + 1e-3))

    monkeypatch.setattr(peers, name, perturbed)
    with pytest.raises(peers.ValuesDisagree, match=f"{kind} packloss_fused value"):
        peers.check_fused(kind, ["naive_eager", "packloss_fused"], 32, 16, 128, "cpu")


def test_missing_peers_are_skipped_with_a_note(monkeypatch):
    for module in (
        "trl",
        "trl.kernels",
        "verl.trainer.ppo.core_algos",
        "cut_cross_entropy",
        "liger_kernel.chunked_loss",
    ):
        monkeypatch.setitem(sys.modules, module, None)  # importing it now raises ImportError
    notes: list[str] = []
    assert peers.run_rl(96, 5, False, 1, 1, lambda _d: None, notes) == []
    assert any(n.startswith("rl/dapo·trl: trl not importable") for n in notes), notes
    assert any(n.startswith("rl/ppo_clip·verl, rl/dppo_tv·verl: verl") for n in notes), notes
    monkeypatch.setattr(peers, "run_fresh", lambda target, kw: {"time_ms": 1.0, "peak_bytes": 1, "value": 0.0})
    rows = peers.run_fused("head", (32, 16, 128), (32, 16, 128), 1, "cpu", lambda _d: None, notes)
    assert [r["variant"] for r in rows] == ["naive_eager", "packloss_fused"]
    assert any(n.startswith("head/cce_torch_compile: cut_cross_entropy not importable") for n in notes), notes
    assert any(n.startswith("head/trl_chunked: trl.kernels not importable") for n in notes), notes


def test_trl_fused_head_agrees_with_the_materialised_head():
    """TRL's own ``ChunkedLogProbFunction`` (installed with the peers) gives the naive head's values and
    gradients; vocab 300 with 128-wide tiles would expose a tile-edge error."""
    errors = peers.check_fused("head", ["naive_eager", "trl_chunked", "packloss_fused"], 40, 16, 300, "cpu")
    assert set(errors) == {"trl_chunked", "packloss_fused"} and max(errors.values()) < peers.HEAD_RTOL


def test_cuda_is_refused():
    with pytest.raises(ValueError, match="CPU only"):
        peers.run("cuda", True)


@pytest.mark.parametrize("compiled", [True, False])
def test_compiled_distill_row_only_with_compiled_columns_and_every_packloss_row_has_ratios(monkeypatch, compiled):
    """``packloss_fused_compiled`` (``impl="compiled"``, Liger's setting) runs only with compiled columns;
    each packloss row is divided by each peer row (wiring only: agreement and timing are stubbed)."""
    times = {"naive_eager": 8.0, "packloss_fused": 6.0, "packloss_fused_compiled": 5.0, "liger_compiled": 5.5}
    monkeypatch.setattr(peers, "_import", lambda module: (object(), None))  # Liger need not be installed
    monkeypatch.setattr(peers, "check_fused", lambda kind, variants, *a: {v: 0.0 for v in variants[1:]})
    monkeypatch.setattr(
        peers, "run_fresh", lambda target, kw: {"time_ms": times[kw["variant"]], "peak_bytes": 10, "value": 0.0}
    )
    rows = {r["variant"]: r for r in peers.run_fused("distill", (8, 4, 16), (8, 4, 16), 1, "cpu", print, [], compiled)}
    ours = ["packloss_fused", "packloss_fused_compiled"] if compiled else ["packloss_fused"]
    assert sorted(rows) == sorted(["naive_eager", "liger_compiled", *ours])
    for variant in ours:
        assert rows[variant]["time_vs_liger_compiled"] == pytest.approx(times[variant] / 5.5)


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
    from packloss.vocab import linear_logprobs

    n, h, v = 300, 16, 2500
    hidden, weight, labels = peers._head_inputs(n, h, v, "cpu", 0)
    with torch.no_grad(), _MatmulFlops() as floor:
        peers.head_matmuls(variant)(hidden, weight)
    assert (floor.flops, floor.other) == (count * 2 * n * h * v, 0)
    if count == 4:
        with _MatmulFlops() as head:
            torch.autograd.grad(
                linear_logprobs(hidden, weight, labels, return_entropy=False)[0].sum(), [hidden, weight]
            )
        assert head.flops == floor.flops and head.other > 0


def test_head_floor_rows_are_divided_by_every_head_row(monkeypatch):
    monkeypatch.setattr(
        peers,
        "run_fresh",
        lambda target, kw: {"time_ms": {"matmuls_packloss_4": 4.0}.get(kw["variant"], 3.0), "peak_bytes": 1},
    )
    head_rows = [{"variant": "packloss_fused", "time_ms": 5.0}, {"variant": "cce_torch_compile", "time_ms": 4.5}]
    rows = {r["variant"]: r for r in peers.run_head_floors((8, 4, 16), 1, "cpu", lambda _d: None, head_rows)}
    assert set(rows) == set(peers.HEAD_FLOORS)
    assert rows["matmuls_packloss_4"]["time_vs_cce_torch_compile"] == pytest.approx(4.0 / 4.5)
    assert rows["matmuls_materialised_3"]["time_vs_packloss_fused"] == pytest.approx(3.0 / 5.0)
    with pytest.raises(ValueError, match="unknown variant"):
        peers.head_matmuls("matmuls_5")
