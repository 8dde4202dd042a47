"""Structural measurement: count the aten operations and the device→host syncs of a piece of code.

On a GPU the aten-op count is the kernel-launch count; on a CPU it is the same structural fact. A
sync-causing op is one whose output size or value the host must read from the device.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "SYNC_OPS"]

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
