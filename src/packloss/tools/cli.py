"""The ``packloss`` command.

* ``packloss bench [loss|distill|head|all] [--device cpu|cuda] [--quick] [--out DIR]`` runs the
  benchmark suites (:mod:`packloss.tools.bench`), prints a table per suite, writes ``results.json``
  and PNG plots.
* ``packloss check MODULE:FUNCTION [--kwargs JSON]`` tells whether a custom rl loss function is
  additive over the sequences of a packed bin (exit 0 PASS, 1 FAIL, 2 cannot check).
* ``packloss demo [--quick] [--nproc N] [--out DIR] ...`` runs the end-to-end demo (SFT, on-policy
  distillation and RL of tiny models on packed bins; needs the ``hf`` extra), see
  :mod:`packloss.tools.demo`.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["main", "build_parser", "run_suite", "positive_int", "device_name", "prepare_out", "SUITES"]

SUITES = ("loss", "distill", "head")


def positive_int(text: str) -> int:
    """argparse ``type=`` for counts: an int of at least 1 (else a usage error naming the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def device_name(text: str) -> str:
    """argparse ``type=`` for ``--device``: ``cpu``, ``cuda`` or ``cuda:N``."""
    if text in ("cpu", "cuda") or re.fullmatch(r"cuda:\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")


def prepare_out(out: Path) -> str | None:
    """Create the ``--out`` folder and check that a file can be written in it; why not, or None."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        return f"--out {str(out)!r} is not a writable folder: {exc.strerror or type(exc).__name__}"
    return None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: subcommands ``bench``, ``check`` and ``demo``, each with ``--help``."""
    parser = argparse.ArgumentParser(
        prog="packloss", description="Sync-free loss functions for LLM post-training on packed micro-batches."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = sub.add_parser(
        "bench",
        help="run the benchmark suites: tables, results.json and plots",
        description="Time the loss paths against their references (and, for distill/head, their peak memory).",
    )
    bench.add_argument(
        "suite",
        nargs="?",
        default="all",
        choices=(*SUITES, "peers", "cp", "trainers", "all"),
        help="suite to run (default all: loss, distill, head); peers: the same data through TRL, verl, "
        "cut-cross-entropy and Liger where installed (CPU); cp: a bin split over context-parallel gloo ranks; "
        "trainers: one step of TRL's GRPOTrainer and PacklossGRPOTrainer at Qwen2's vocabulary (CPU)",
    )
    bench.add_argument("--device", type=device_name, default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    bench.add_argument("--quick", action="store_true", help="small sizes and few repeats (about a minute on 2 cores)")
    bench.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder (default bench-out)")
    bench.add_argument("--no-compile", action="store_true", help="skip the torch.compile column of the loss suite")
    bench.add_argument(
        "--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's choice)"
    )

    check = sub.add_parser(
        "check",
        help="check that a custom rl loss function is additive over packed sequences",
        description=(
            "Call a custom rl loss per sequence (as before prime-rl PR #2951) and once per packed bin "
            "(packloss), compare losses and gradients; exit 0 PASS, 1 FAIL, 2 cannot import/check."
        ),
    )
    check.add_argument("target", metavar="MODULE:FUNCTION", help="the loss function, importable from here")
    check.add_argument("--kwargs", default=None, metavar="JSON", help="keyword arguments as a JSON object")

    from packloss.tools import demo

    demo.add_arguments(
        sub.add_parser(
            "demo",
            help="end-to-end demo: SFT, on-policy distillation and RL of tiny models on packed bins",
            description=demo.__doc__.split("\n\n")[0],
        )
    )
    return parser


def run_suite(name: str, device: str, quick: bool, progress: Callable[[str], None], use_compile: bool) -> dict:
    """Import and run one suite; a missing or failing suite returns ``{"rows": [], "error": ...}``."""
    start = time.perf_counter()
    try:
        module = importlib.import_module(f"packloss.tools.bench.{name}")
        if name == "loss":
            result = module.run(device, quick, progress, use_compile=use_compile)
        else:
            result = module.run(device, quick, progress)
    except Exception as exc:  # one suite's failure must not lose the others' figures
        result = {"rows": [], "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    result["wall_s"] = time.perf_counter() - start
    return result


def _usage_error(command: str, message: str) -> int:
    """Print the one-line ``packloss COMMAND: error: ...`` to stderr; the usage exit code 2."""
    print(f"packloss {command}: error: {message}", file=sys.stderr)
    return 2


def _bench(args: argparse.Namespace) -> int:
    import torch

    from packloss.tools.bench import report

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        return _usage_error("bench", f"--device {args.device} but CUDA is not available")
    error = prepare_out(args.out)
    if error is not None:
        return _usage_error("bench", error)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    suites = SUITES if args.suite == "all" else (args.suite,)
    results: dict[str, dict] = {}
    with report.progress_display() as progress:
        for name in suites:
            progress.suite(name)
            results[name] = run_suite(name, args.device, args.quick, progress, not args.no_compile)
    payload = {
        "machine": report.machine_info(args.device),
        "options": {
            "suite": args.suite,
            "device": args.device,
            "quick": args.quick,
            "no_compile": args.no_compile,
            "threads": args.threads,
        },
        "suites": results,
    }
    report.write_json(args.out / "results.json", payload)
    plots = report.write_plots(results, args.out)
    report.print_tables(results)
    print(f"\nwrote {args.out / 'results.json'}" + "".join(f", {p}" for p in plots))
    return 1 if any("error" in r for r in results.values()) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``packloss`` console script and of ``python -m packloss``; the exit code."""
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    if args.command == "demo":
        from packloss.tools import demo

        return demo.run(args)
    from packloss.tools.check import run as run_check

    return run_check(args.target, args.kwargs)
