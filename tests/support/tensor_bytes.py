"""How many bytes of tensor storage a piece of code holds at once, measured from outside it.

    with TensorBytes() as meter:
        export(...)
    meter.peak   # the most bytes of storages alive together, made inside the block

A `TorchDispatchMode` sees the output of every torch operation run inside the block (an
allocation, a copy, a dtype conversion, a view of a memory-mapped file that safetensors
reads); each storage is counted once, by its address, from the operation that first returns
it until the storage itself is freed (a finalizer on the storage object, which torch keeps
alive as long as any tensor uses it, views included). Storages made before the block are not
counted, nor is memory that is not a tensor's.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class TensorBytes(TorchDispatchMode):
    """Live and peak bytes of the tensor storages made inside the block (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._count(t.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if not size or key in self._sizes:
            return
        self._sizes[key] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key)
