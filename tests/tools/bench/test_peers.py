"""``packloss bench peers`` on tiny sizes: one row per variant, each checked before it is timed, the
tables and ``results.json``. No timing is asserted."""

from __future__ import annotations

import io
import json

import pytest

from packloss.tools.bench import peers, peers_rl, peers_vocab, report
from packloss.tools.cli import run_suite

TINY = peers.Sizes(
    rl_shapes=((96, 5),),
    compiled=False,
    rl_warmup=1,
    rl_repeat=2,
    fused_shapes=((32, 16, 128),),
    fused_check=(32, 16, 128),
    fused_repeat=2,
    fused_rounds=1,
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
        assert set(rows) == {"packloss_eager", peer, "naive_eager"}
        ours = rows["packloss_eager"]
        assert 0 <= ours["grad_rel_err"] <= peers_rl.RL_RTOL and ours["loss_rel_diff"] >= 0
        assert ours[f"vs_{peer}"] == pytest.approx(ours["time_ms"] / rows[peer]["time_ms"])
    for kind in ("head", "distill"):
        rows = _rows(result, kind)
        assert {"naive_eager", "packloss_fused"} <= set(rows)
        for variant, row in rows.items():
            assert row["time_ms"] > 0 and row["peak_bytes"] is not None
            assert row["value"] == pytest.approx(rows["naive_eager"]["value"], rel=1e-4)
            if variant != "naive_eager":
                assert row["max_rel_err"] <= peers_vocab.HEAD_RTOL


def test_one_table_per_comparison_and_json(tiny_run):
    result, text, payload = tiny_run
    for comparison in (*RL_COMPARISONS, "gae·verl", "head", "head floor", "distill"):
        assert f"packloss bench peers: {comparison}" in text
    assert payload["suites"]["peers"]["rows"] == json.loads(json.dumps(result["rows"]))
    for note in result["notes"]:  # cut-cross-entropy / Liger when not installed
        assert f"note: {note}" in text


def test_cuda_is_refused():
    with pytest.raises(ValueError, match="CPU only"):
        peers.run("cuda", True)
