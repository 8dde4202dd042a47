"""The demo's output: progress bars, the log (``metrics.jsonl``), the final tables, the curves and
the acceptance figures."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

__all__ = ["Progress", "progress_kind", "Recorder", "format_table", "plot_curves", "acceptance"]


class Progress:
    """A progress bar per phase with live fields: rich or tqdm on a terminal, plain lines otherwise."""

    def __init__(self, kind: str, phase: str, total: int) -> None:
        self.kind, self.phase, self.total, self.step = kind, phase, total, 0
        self._bar = None
        if kind == "rich":
            from rich import progress as rp

            columns = (rp.BarColumn(), rp.MofNCompleteColumn(), rp.TimeElapsedColumn(), "{task.fields[live]}")
            self._bar = rp.Progress("[bold]{task.description}", *columns)
            self._bar.start()
            self._task = self._bar.add_task(phase, total=total, live="")
        elif kind == "tqdm":
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=phase)

    def update(self, live: dict[str, float]) -> None:
        self.step += 1
        text = " ".join(f"{k}={v:.3g}" for k, v in live.items())
        if self.kind == "rich":
            self._bar.update(self._task, advance=1, live=text)
        elif self.kind == "tqdm":
            self._bar.set_postfix_str(text)
            self._bar.update(1)
        elif self.kind == "plain" and (self.step % max(1, self.total // 5) == 0 or self.step == self.total):
            print(f"  {self.phase} {self.step}/{self.total} {text}", flush=True)

    def close(self) -> None:
        if self.kind == "rich":
            self._bar.stop()
        elif self.kind == "tqdm":
            self._bar.close()


def progress_kind(choice: str) -> str:
    """The progress display for ``--progress``: ``auto`` is rich or tqdm on a terminal, else plain lines."""
    if choice != "auto":
        return choice
    if not sys.stdout.isatty():
        return "plain"
    for name in ("rich", "tqdm"):
        with contextlib.suppress(ImportError):
            __import__(name)
            return name
    return "plain"


def format_table(summary: dict) -> str:
    """The final tables (checkpoints, then phases) as aligned plain text."""
    rows = [("checkpoint", "reward", "exact", "KL to teacher")]
    for name, e in summary["evals"].items():
        kl = "" if e.get("kl") is None else f"{e['kl']:.4f}"
        rows.append((name, f"{e['reward']:.3f}", f"{e['exact']:.3f}", kl))
    rows2 = [("phase", "steps", "tokens", "tokens/s", "wall s", "empty bins")]
    for name, p in summary["phases"].items():
        rows2.append((name, str(p["steps"]), str(p["tokens"]), f"{p['tokens_per_s']:.0f}", f"{p['wall_s']:.1f}",
                      str(sum(p["empty_bins"].values()))))  # fmt: skip
    return _align(rows) + "\n\n" + _align(rows2)


def _cell(text: str, width: int, left: bool) -> str:
    return text.ljust(width) if left else text.rjust(width)


def _align(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    cells = [[_cell(c, w, i == 0) for i, (c, w) in enumerate(zip(r, widths, strict=True))] for r in rows]
    lines = ["  ".join(r).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_curves(records: list[dict], path: Path) -> bool:
    """Reward, KL to teacher and loss against the step of each phase, to ``path`` (PNG). Returns
    False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    phases = list(dict.fromkeys(r["phase"] for r in records))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    offset, colors = 0, dict(zip(phases, ("tab:blue", "tab:orange", "tab:green"), strict=False))
    for phase in phases:
        train = [r for r in records if r["phase"] == phase and r["kind"] == "train"]
        evals = [r for r in records if r["phase"] == phase and r["kind"] == "eval"]
        c = colors[phase]
        xs = [offset + r["step"] for r in train]
        if any("reward" in r for r in train):
            axes[0].plot(xs, [r["reward"] for r in train], color=c, alpha=0.35, lw=1)
        axes[0].plot([offset + r["step"] for r in evals], [r["reward"] for r in evals], "o-", color=c, label=phase)
        if any("kl" in r for r in train):
            axes[1].plot(xs, [r["kl"] for r in train], color=c, alpha=0.35, lw=1)
        if any(r.get("kl") is not None for r in evals):
            axes[1].plot([offset + r["step"] for r in evals], [r["kl"] for r in evals], "o-", color=c, label=phase)
        axes[2].plot(xs, [r["loss"] for r in train], color=c, lw=1, label=phase)
        offset += max([r["step"] for r in train], default=0)
        for ax in axes:
            ax.axvline(offset, color="grey", lw=0.5, ls=":")
    axes[0].set(title="held-out reward (dots) / train reward (line)", xlabel="step", ylim=(0, 1.02))
    axes[1].set(title="KL(student‖teacher): held-out (dots) / sampled (line)", xlabel="step", yscale="log")
    axes[2].set(title="loss (sampled distillation's is centred: ≈ 0)", xlabel="step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


class Recorder:
    """Rank 0's log: ``metrics.jsonl`` lines, the records for the plot, progress bars."""

    def __init__(self, out: Path | None, progress: str, active: bool) -> None:
        self.active, self.progress, self.records = active, progress, []
        self._file = open(out / "metrics.jsonl", "w") if out is not None and active else None  # noqa: SIM115

    def log(self, record: dict) -> None:
        if not self.active:
            return
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def bar(self, phase: str, total: int) -> Progress:
        return Progress(self.progress if self.active else "none", phase, total)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def acceptance(evals: dict[str, dict]) -> dict[str, float | bool]:
    """The issue's acceptance figures from the checkpoints."""
    teacher, init = evals["teacher_sft"], evals["student_init"]
    after, rl = evals["student_distill"], evals["student_rl"]
    return {
        "distill_reward_fraction_of_teacher": after["reward"] / max(teacher["reward"], 1e-9),
        "student_reward_gain": rl["reward"] - init["reward"],
        "rl_reward_change": rl["reward"] - after["reward"],
        "kl_reduction_factor": init["kl"] / max(after["kl"], 1e-12),
        "distill_reaches_90pct_of_teacher": after["reward"] >= 0.9 * teacher["reward"],
        "rl_does_not_lower_reward": rl["reward"] >= after["reward"] - 0.01,
        "kl_falls_5x": init["kl"] >= 5 * after["kl"],
    }
