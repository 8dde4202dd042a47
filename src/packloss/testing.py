"""Structural measurement: count the aten operations and the device→host syncs of a piece of code.

On a GPU the aten-op count is the kernel-launch count; on a CPU it is the same structural fact. A
sync-causing op is one whose output size or value the host must read from the device.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "SYNC_OPS", "ARCHETYPES", "make_archetype", "random_seq_lens", "run_gloo"]

SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense",  # sync-ok (a name): .item(), bool(tensor), .tolist(), int(), float()
        "aten.is_nonzero",
        "aten.nonzero",
        "aten.nonzero_static",
        "aten.masked_select",  # sync-ok (a name)
        "aten.masked_scatter",
        "aten.unique",
        "aten._unique",
        "aten._unique2",
        "aten.unique_consecutive",
        "aten.unique_dim",
        "aten.equal",
        "aten.allclose",
    }
)


def _name(func) -> str:
    return f"aten.{func.__name__.split('.')[0]}" if hasattr(func, "__name__") else str(func)


class OpCounter(TorchDispatchMode):
    """A ``TorchDispatchMode`` that counts every aten op run inside it, forward and backward.

    Attributes after the ``with`` block: ``ops`` (Counter of op names), ``total``, ``syncs``
    (Counter of sync-causing ops), ``num_syncs``. Boolean-mask indexing (``aten.index`` with a bool
    index) and ``repeat_interleave`` without ``output_size`` count as syncs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        self.ops[name] += 1
        if name in SYNC_OPS or self._is_sync(name, args, kwargs):
            self.syncs[name] += 1
        return func(*args, **kwargs)

    @staticmethod
    def _is_sync(name: str, args, kwargs) -> bool:
        if name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
        if name == "aten.repeat_interleave":
            return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
        return False

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())


ARCHETYPES = ("hot", "weighted_grpo", "opd", "echo", "sdft", "all_empty", "dummy")
"""The packed-bin archetypes of DESIGN.md §8 (see :func:`make_archetype`)."""


def random_seq_lens(num_tokens: int, num_seqs: int, generator: torch.Generator) -> list[int]:
    """``num_seqs`` positive lengths of mixed sizes summing to ``num_tokens``, one of them 1 (if S > 1)."""
    if not 1 <= num_seqs <= num_tokens:
        raise ValueError(f"need 1 <= num_seqs <= num_tokens, got {num_seqs} and {num_tokens}")
    if num_seqs == 1:
        return [num_tokens]
    weights = torch.rand(num_seqs - 1, generator=generator) * 3 + 0.25
    rest = num_tokens - 1 - (num_seqs - 1)  # tokens beyond one per sequence and the length-1 sequence
    extra = torch.floor(weights / weights.sum() * rest).to(torch.long)
    extra[0] += rest - int(extra.sum())
    lens = [1] + [1 + int(e) for e in extra]
    perm = torch.randperm(num_seqs, generator=generator).tolist()  # sync-ok: host-side test data
    return [lens[i] for i in perm]


def make_archetype(
    name: str,
    seq_lens: list[int],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    drift: float = 0.35,
):
    """A packed bin of one archetype with enough trainer/inference drift that trust regions fire.

    Every sequence starts with prompt tokens outside ``loss_mask`` (about a third of it); a length-1
    sequence is one completion token. ``trainer_logprobs`` is a leaf that requires grad.

    Archetypes: ``hot`` (no weight streams) · ``weighted_grpo`` (rl weights 0/0.5/1/2, one sequence
    all 0) · ``opd`` (rl weights 0, ref_kl 1 on the mask) · ``echo`` (rl hot path + ce 0.1 on
    observation tokens outside the mask) · ``sdft`` (rl hot path and ref_kl on part of the mask) ·
    ``all_empty`` (every weight 0) · ``dummy`` (mask all False, no streams).
    """
    from packloss.batch import PackedBatch

    if name not in ARCHETYPES:
        raise ValueError(f"unknown archetype {name!r}; choose from {ARCHETYPES}")
    g = torch.Generator().manual_seed(seed)
    n = sum(seq_lens)
    p_inf = torch.rand(n, generator=g) * 0.9 + 0.05  # [N]
    p_trn = (p_inf + (torch.rand(n, generator=g) * 2 - 1) * drift).clamp(1e-3, 1.0)
    p_ref = (p_inf + (torch.rand(n, generator=g) * 2 - 1) * drift).clamp(1e-3, 1.0)
    inf, trn, ref = p_inf.log(), p_trn.log(), p_ref.log()
    adv_seq = torch.randn(len(seq_lens), generator=g)
    advantages = torch.repeat_interleave(adv_seq, torch.tensor(seq_lens), output_size=n)
    pos = torch.cat([torch.arange(k) for k in seq_lens])  # [N] position within its sequence
    prompt_len = torch.repeat_interleave(torch.tensor([k // 3 for k in seq_lens]), torch.tensor(seq_lens))
    completion = pos >= prompt_len
    observation = completion & (torch.rand(n, generator=g) < 0.25) & (pos > prompt_len)
    loss_mask = completion & ~observation
    streams: dict[str, torch.Tensor | None] = {}
    if name == "weighted_grpo":
        choices = torch.tensor([0.0, 0.5, 1.0, 2.0])
        w = choices[torch.randint(0, 4, (n,), generator=g)]
        seq_ids = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
        streams["rl_weights"] = torch.where(seq_ids == 0, 0.0, w)
    elif name == "opd":
        streams["rl_weights"] = torch.zeros(n)
        streams["ref_kl_weights"] = loss_mask.to(torch.float32)
    elif name == "echo":
        streams["ce_weights"] = observation.to(torch.float32) * 0.1
    elif name == "sdft":
        streams["ref_kl_weights"] = (loss_mask & (torch.rand(n, generator=g) < 0.6)).to(torch.float32)
    elif name == "all_empty":
        streams["rl_weights"] = torch.zeros(n)
        streams["ce_weights"] = torch.zeros(n)
        streams["ref_kl_weights"] = torch.zeros(n)
    elif name == "dummy":
        loss_mask = torch.zeros(n, dtype=torch.bool)
    needs_ref = "ref_kl_weights" in streams
    to = dict(dtype=dtype, device=device)
    return PackedBatch(
        trainer_logprobs=trn.to(**to).requires_grad_(),
        inference_logprobs=inf.to(**to),
        loss_mask=loss_mask.to(device),
        seq_lens=list(seq_lens),
        advantages=advantages.to(**to),
        ref_logprobs=ref.to(**to) if needs_ref else None,
        **{k: v.to(**to) for k, v in streams.items()},
    )


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
    procs = [
        ctx.Process(target=_gloo_entry, args=(r, world_size, port, fn, args, results)) for r in range(world_size)
    ]
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
