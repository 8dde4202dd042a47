"""packloss.tools.bench.report: the tables (loss and generic columns, formatting, groups, errors), the
progress lines, ``results.json``, machine info and the PNG plots (those of ``bench loss --quick`` too)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import torch
from PIL import Image

from packloss.tools.bench import report


def test_bench_plots_are_valid_pngs(quick_run):
    path = quick_run[1] / "loss_time.png"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


def test_loss_table_has_fixed_columns_and_formats_values():
    row = {"archetype": "hot", "num_tokens": 4096, "num_seqs": 16, "variant": "eager", "time_ms": 1.23456,
           "speedup_vs_reference": 12345.6, "aten_ops": 120, "syncs": 0, "first_call_s": None, "graphs": None,
           "peak_bytes": 3 << 20}  # fmt: skip
    header, cells = report.table_rows("loss", [row])
    assert header == ["archetype", "tokens", "seqs/bin", "implementation", "median ms", "× reference", "aten ops",
                      "syncs", "1st call s", "graphs"]  # fmt: skip
    assert cells == [["hot", "4096", "16", "eager", "1.23", "12,346", "120", "0", "–", "–"]]


def test_generic_table_puts_shape_variant_time_and_mib_first_then_scalars():
    rows = [
        {"shape": "64x128", "variant": "naive", "time_ms": 2.5, "peak_bytes": 3 << 20, "ok": True, "cfg": {"a": 1}},
        {"shape": "64x128", "variant": "fused", "time_ms": 0.5, "peak_bytes": None, "ratio": 0.25, "tags": [1]},
    ]
    header, cells = report.table_rows("distill", rows)
    assert header == ["shape", "variant", "time_ms", "peak MiB", "ok", "ratio"]  # dicts and lists are left out
    assert cells == [["64x128", "naive", "2.5", "3", "True", "–"], ["64x128", "fused", "0.5", "–", "–", "0.25"]]


def test_print_tables_groups_comparisons_and_prints_errors_summaries_and_notes():
    results = {
        "loss": {"error": "boom"},
        "peers": {
            "rows": [
                {"comparison": "rl/a", "shape": "s", "variant": "x", "time_ms": 1.0, "peak_bytes": None},
                {"comparison": "rl/b", "shape": "s", "variant": "y", "time_ms": 2.0, "peak_bytes": None},
            ],
            "summary": {"hot": {"speedup": 2.0}},
            "notes": ["verl is not installed"],
        },
    }
    out = io.StringIO()
    report.print_tables(results, out)
    text = out.getvalue()
    assert "packloss bench loss: FAILED\nboom" in text
    assert "packloss bench peers: rl/a" in text and "packloss bench peers: rl/b" in text
    assert "comparison" not in text  # the grouping column is the title
    assert "hot: speedup 2" in text and "note: verl is not installed" in text


def test_progress_lines_without_a_terminal():
    out = io.StringIO()
    with report.progress_display(out) as progress:
        progress.suite("loss")
        progress("loss hot eager")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"\[\s*\d+\.\ds\] suite loss", lines[0]) and lines[1].endswith("] loss hot eager")


def test_results_json_and_machine_info(tmp_path):
    info = report.machine_info("cpu")
    assert {"platform", "cpu_model", "cpu_cores", "python", "torch", "torch_threads", "device", "date"} <= set(info)
    assert info["torch"] == torch.__version__ and info["device"] == "cpu" and "gpu" not in info
    path = tmp_path / "results.json"
    report.write_json(path, {"machine": info, "out": Path("/x/y"), "rows": [1.5]})
    assert json.loads(path.read_text()) == {"machine": info, "out": "/x/y", "rows": [1.5]}  # a Path as str


def test_memory_plots_only_for_suites_with_peaks(tmp_path):
    results = {
        "loss": {"rows": []},
        "head": {"error": "missing", "rows": []},
        "distill": {"rows": [{"shape": "8x16", "variant": v, "time_ms": 1.0, "peak_bytes": b}
                             for v, b in (("naive_eager", 3 << 20), ("packloss_eager", 1 << 20))]},
    }  # fmt: skip
    written = report.write_plots(results, tmp_path)
    assert written == [tmp_path / "distill_memory.png"]
    with Image.open(written[0]) as image:
        assert image.format == "PNG"
