"""Run a function in several processes joined by a gloo process group (multi-rank tests on CPU)."""

from __future__ import annotations

import torch

__all__ = ["run_gloo", "run_program"]


def _gloo_entry(rank, world_size, port, fn, args, queue):
    import io

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        # Serialised to bytes: tensors sent as shared-memory handles die with this process.
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)
        queue.put((rank, buffer.getvalue()))
    except BaseException:
        import traceback

        queue.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_gloo(fn, world_size: int = 2, args: tuple = (), timeout: float = 120.0) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes joined by a gloo group.

    Returns the per-rank results (picklable) in rank order. A worker that fails, or a group that has
    not finished after ``timeout`` seconds (a hang), raises instead of blocking the caller.
    """
    import io
    import multiprocessing as mp
    import queue as queue_module
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_gloo_entry, args=(r, world_size, port, fn, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    try:
        for _ in range(world_size):
            rank, payload = results.get(timeout=timeout)
            if isinstance(payload, str):
                raise RuntimeError(f"gloo rank {rank} failed:\n{payload}")
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    except queue_module.Empty:
        codes = [p.exitcode for p in procs]
        raise TimeoutError(f"gloo group did not finish within {timeout}s; exit codes {codes}") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return [out[r] for r in range(world_size)]


def run_program(rank: int, world_size: int, program: str, name: str, filename: str = "<program>") -> object:
    """A :func:`run_gloo` worker running Python source: ``exec`` the ``program`` and return its function
    ``name`` called with ``(rank, world_size)`` (docs snippets; tests whose own module is slow to import
    in every spawned rank)."""
    namespace: dict = {}
    exec(compile(program, filename, "exec"), namespace)
    return namespace[name](rank, world_size)
