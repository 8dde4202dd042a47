"""Output of ``packloss bench``: terminal tables, a progress display, ``results.json`` and PNG plots.

``rich`` and ``matplotlib`` (the ``bench`` extra) are imported here only, inside the functions that
use them; without ``rich`` the tables and progress fall back to plain text, without ``matplotlib``
no plot is written (and :func:`write_plots` says so).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import torch

__all__ = ["machine_info", "write_json", "print_tables", "progress_display", "write_plots", "table_rows"]

_LOSS_COLUMNS = (
    ("archetype", "archetype"),
    ("num_tokens", "tokens"),
    ("num_seqs", "seqs/bin"),
    ("variant", "implementation"),
    ("time_ms", "median ms"),
    ("speedup_vs_reference", "× reference"),
    ("aten_ops", "aten ops"),
    ("syncs", "syncs"),
    ("first_call_s", "1st call s"),
    ("graphs", "graphs"),
)
_GENERIC_FIRST = ("shape", "variant", "time_ms", "peak_bytes")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str) -> dict[str, Any]:
    """Platform, CPU model, cores, Python and torch versions, threads, device (and GPU name), date."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        info["cuda"] = torch.version.cuda
    return info


def write_json(path: Path, payload: dict) -> None:
    """``payload`` as indented JSON."""
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def table_rows(suite: str, rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """(header, formatted cells) of one suite's table: fixed columns for ``loss``; for the others
    ``shape``, ``variant``, ``time_ms``, ``peak_bytes`` (as MiB) then every other scalar field."""
    if suite == "loss":
        keys = [k for k, _ in _LOSS_COLUMNS]
        header = [h for _, h in _LOSS_COLUMNS]
    else:
        extra = [k for r in rows for k, v in r.items() if k not in _GENERIC_FIRST and not isinstance(v, dict | list)]
        keys = [*_GENERIC_FIRST, *dict.fromkeys(extra)]
        header = ["peak MiB" if k == "peak_bytes" else k for k in keys]
    cells = []
    for row in rows:
        values = [row.get(k) for k in keys]
        if "peak_bytes" in keys and suite != "loss":
            i = keys.index("peak_bytes")
            values[i] = None if values[i] is None else values[i] / 2**20
        cells.append([_fmt(v) for v in values])
    return header, cells


def _plain_table(title: str, header: list[str], cells: list[list[str]], out: TextIO) -> None:
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
    print(f"\n{title}", file=out)
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)), file=out)
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)), file=out)


def _say(console: Any, text: str, out: TextIO, style: str | None = None) -> None:
    if console is None:
        print(text, file=out)
    else:
        console.print(text, style=style, markup=False, highlight=False)


def print_tables(results: dict[str, dict], out: TextIO = sys.stdout) -> None:
    """One table per suite (rich if installed, plain text otherwise); a failed suite prints its error."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None  # noqa: N806
    console = None
    if Console is not None:
        console = Console(file=out)
        if not console.is_terminal:  # a file or a pipe: wide enough for every column, not 80
            console = Console(file=out, width=160)
    for suite, result in results.items():
        title = f"packloss bench {suite}"
        if "error" in result:
            _say(console, f"{title}: FAILED\n{result['error']}", out, style="bold red")
            continue
        for group_title, rows in _groups(title, result["rows"]):
            header, cells = table_rows(suite, rows)
            if console is None:
                _plain_table(group_title, header, cells, out)
            else:
                table = Table(title=group_title)
                for h in header:
                    table.add_column(h, justify="right")
                for c in cells:
                    table.add_row(*c)
                console.print(table)
        for archetype, figures in result.get("summary", {}).items():
            _say(console, f"{archetype}: " + ", ".join(f"{k} {v:.3g}" for k, v in figures.items()), out)
        for note in result.get("notes", []):
            _say(console, f"note: {note}", out)


def _groups(title: str, rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """One table per ``comparison`` (the ``peers`` suite's rows carry one), else the suite's one table."""
    if not any("comparison" in r for r in rows):
        return [(title, rows)]
    names = dict.fromkeys(r.get("comparison") for r in rows)
    return [(f"{title}: {name}", [{k: v for k, v in r.items() if k != "comparison"} for r in rows
                                  if r.get("comparison") == name]) for name in names]  # fmt: skip


@contextmanager
def progress_display(out: TextIO = sys.stderr) -> Iterator[Any]:
    """A callable ``progress(description)``: a rich spinner, step count and elapsed time when rich
    is installed and ``out`` is a terminal, one timestamped line per step otherwise (a log file
    then shows where the run is). ``progress.suite(name)`` starts a new suite's bar."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    except ImportError:
        Console = None  # noqa: N806
    if Console is None or not out.isatty():
        yield _PlainProgress(out)
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed} steps"))
    with Progress(*columns, TimeElapsedColumn(), console=Console(file=out), transient=False) as bar:
        yield _RichProgress(bar)


class _RichProgress:
    """``progress(description)`` on a rich ``Progress``: one task per suite (no total: pulsing bar)."""

    def __init__(self, bar: Any) -> None:
        self._bar = bar
        self._task: Any = None
        self._name = ""

    def suite(self, name: str) -> None:
        if self._task is not None:
            self._bar.update(self._task, description=f"{self._name} done")
        self._name = name
        self._task = self._bar.add_task(name, total=None)

    def __call__(self, description: str) -> None:
        self._bar.update(self._task, description=description, advance=1)


class _PlainProgress:
    """``progress(description)`` as a timestamped line per step."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._start = time.perf_counter()

    def suite(self, name: str) -> None:
        self(f"suite {name}")

    def __call__(self, description: str) -> None:
        print(f"[{time.perf_counter() - self._start:7.1f}s] {description}", file=self._out, flush=True)


def _plot_loss_times(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    styles = {
        "reference": ("o", "-"),
        "compat": ("d", "-."),
        "compat_floor": ("v", "-."),
        "eager": ("s", "--"),
        "compiled": ("^", ":"),
    }
    archetypes = list(dict.fromkeys(r["archetype"] for r in rows))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        marker, line = styles.get(variant, ("x", "-."))
        for i, archetype in enumerate(archetypes):
            mine = [r for r in rows if (r["variant"], r["archetype"]) == (variant, archetype)]
            points = sorted((r["num_seqs"], r["time_ms"]) for r in mine)
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker=marker, linestyle=line, color=f"C{i}", label=f"{variant} · {archetype}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    seq_counts = sorted({r["num_seqs"] for r in rows})
    ax.set_xticks(seq_counts, [str(s) for s in seq_counts])
    ax.set_xlabel("sequences per bin")
    ax.set_ylabel("forward+backward, median ms")
    tokens = sorted({r["num_tokens"] for r in rows})
    ax.set_title(f"compute_loss on a packed bin of {', '.join(map(str, tokens))} tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_memory(suite: str, rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    labels = [f"{r['comparison'] + ' ' if 'comparison' in r else ''}{r['shape']}\n{r['variant']}" for r in rows]
    mib = [r["peak_bytes"] / 2**20 for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows)), 4.5))
    ax.bar(range(len(rows)), mib, color="tab:blue")
    ax.set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("peak memory added by forward+backward, MiB")
    ax.set_title(f"packloss bench {suite}: peak memory")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(results: dict[str, dict], out_dir: Path) -> list[Path]:
    """``loss_time.png`` (log-log time vs sequences per bin) and ``<suite>_memory.png`` for the suites
    whose rows carry ``peak_bytes``; returns the files written (none without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'packloss[bench]'): no plots written", file=sys.stderr)
        return []
    matplotlib.use("Agg")
    written = []
    for suite, result in results.items():
        rows = result.get("rows") or []
        if suite == "loss" and rows:
            path = out_dir / "loss_time.png"
            _plot_loss_times(rows, path)
            written.append(path)
        memory_rows = [r for r in rows if isinstance(r.get("peak_bytes"), int | float)]
        if suite != "loss" and memory_rows:
            path = out_dir / f"{suite}_memory.png"
            _plot_memory(suite, memory_rows, path)
            written.append(path)
    return written
