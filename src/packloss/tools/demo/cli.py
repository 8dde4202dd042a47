"""``packloss demo`` / ``python -m packloss.tools.demo``: the options, the run (one process, or
``--nproc`` spawned DDP workers) and its outputs (table, ``summary.json``, ``params.pt``, curves)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist

from packloss.tools.cli import positive_int, prepare_out
from packloss.tools.demo.config import DEFAULT, QUICK, DemoConfig
from packloss.tools.demo.report import Recorder, acceptance, format_table, plot_curves, progress_kind
from packloss.tools.demo.train import Dist, run_phases

__all__ = ["add_arguments", "run", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``packloss demo`` options."""
    parser.add_argument("--quick", action="store_true", help="a short run (about a minute on 2 CPU cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write metrics.jsonl, summary.json, curves.png, params.pt here")
    parser.add_argument("--nproc", type=positive_int, default=1,
                        help="data-parallel processes (gloo on CPU, NCCL on CUDA)")  # fmt: skip
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--distill", choices=("sampled", "full"), default="full",
                        help="full-vocabulary reverse KL (default) or sampled-token ref_kl")  # fmt: skip
    parser.add_argument("--no-baseline", dest="baseline", action="store_false",
                        help="sampled distillation without the mean baseline (raw advantage ref − trn)")  # fmt: skip
    parser.add_argument("--emulate-ranks", type=positive_int, default=1, metavar="K",
                        help="one process only: accumulate as K data-parallel ranks would, for bit-exact "
                        "comparison with --nproc K (exact for K <= 2)")  # fmt: skip
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads per process")
    parser.add_argument("--progress", choices=("auto", "rich", "tqdm", "plain", "none"), default="auto")
    parser.add_argument("--sft-steps", type=positive_int, default=None)
    parser.add_argument("--distill-steps", type=positive_int, default=None)
    parser.add_argument("--rl-steps", type=positive_int, default=None)


def _usage_error(args: argparse.Namespace) -> str | None:
    """Why the options cannot run (an unwritable ``--out`` included: it is created here), or None."""
    if args.nproc < 1 or args.threads < 1 or args.emulate_ranks < 1:
        return "--nproc, --threads and --emulate-ranks must be at least 1"
    if args.nproc > 1 and args.emulate_ranks > 1:
        return "--emulate-ranks is for one process (it emulates --nproc K)"
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        return f"--device cuda needs {args.nproc} GPU(s), found {torch.cuda.device_count()}"
    return None if args.out is None else prepare_out(Path(args.out))


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit code (2 for unusable options)."""
    args.progress = progress_kind(args.progress)
    error = _usage_error(args)
    if error is not None:
        print(f"packloss demo: error: {error}", file=sys.stderr)
        return 2
    if args.nproc == 1:
        threads = torch.get_num_threads()
        try:
            _worker(0, 1, args, 0)
        finally:
            torch.set_num_threads(threads)  # the caller's setting, when called in-process
        return 0
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    mp.start_processes(_worker, args=(args.nproc, args, _free_port()), nprocs=args.nproc, start_method="spawn")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m packloss.tools.demo [options]``; the exit code."""
    from packloss.tools import demo

    parser = argparse.ArgumentParser(prog="packloss demo", description=demo.__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    """One process of the run: its device, the process group (``world > 1``), the training."""
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        _train(Dist(rank, world, device), args)
        if world > 1:
            # Rank 0 evaluates and writes after the last step; the others wait for it here, so no rank
            # tears its gloo threads down while a peer may still talk to it (a CI run once saw rank 1
            # abort at exit with "terminate called without an active exception").
            dist.barrier()
    finally:
        if world > 1:
            dist.destroy_process_group()


def _config(args: argparse.Namespace) -> DemoConfig:
    """``--quick`` or the default schedule, with the ``--*-steps`` overrides."""
    cfg = QUICK if args.quick else DEFAULT
    steps = {"sft_steps": args.sft_steps, "distill_steps": args.distill_steps, "rl_steps": args.rl_steps}
    return replace(cfg, **{k: v for k, v in steps.items() if v is not None})


def _train(ctx: Dist, args: argparse.Namespace) -> None:
    """Train, then (rank 0) print the tables and write the outputs."""
    cfg = _config(args)
    out = Path(args.out) if args.out else None
    lead = ctx.rank == 0
    if out is not None and lead:
        out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(out, args.progress, lead)
    t0 = time.perf_counter()
    evals, phases, teacher, student = run_phases(ctx, cfg, args, rec)
    rec.close()
    if not lead:
        return
    summary = {
        "config": asdict(cfg),
        "seed": args.seed,
        "quick": args.quick,
        "distill": args.distill,
        "nproc": ctx.world,
        "emulate_ranks": args.emulate_ranks,
        "device": str(ctx.device),
        "threads": args.threads,
        "torch": torch.__version__,
        "wall_s": time.perf_counter() - t0,
        "evals": evals,
        "phases": phases,
        "acceptance": acceptance(evals),
    }
    print()
    print(format_table(summary))
    print(f"\nwall time {summary['wall_s']:.1f} s, {ctx.world} process(es), {ctx.device}")
    if out is not None:
        _write(out, summary, teacher, student, rec.records)


def _write(out: Path, summary: dict, teacher: torch.nn.Module, student: torch.nn.Module, records: list[dict]) -> None:
    """``summary.json``, ``params.pt`` (both models, on the CPU) and ``curves.png``."""
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    params = {"teacher": teacher.state_dict(), "student": student.state_dict()}
    torch.save({k: {n: t.cpu() for n, t in v.items()} for k, v in params.items()}, out / "params.pt")  # sync-ok
    if plot_curves(records, out / "curves.png"):
        print(f"wrote {out / 'metrics.jsonl'}, {out / 'summary.json'}, {out / 'curves.png'}")
