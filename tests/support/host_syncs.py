"""Count the operations that make the host wait for the device, on any device.

A host read of a tensor value (``.item()``, ``float(t)``, ``bool(t)``, ``int(t)``) runs the op
``aten._local_scalar_dense``; ops whose output shape depends on values (``nonzero``,
``masked_select``, ``unique``) read too; and a copy from a GPU to the CPU waits for the kernels
before it. `HostSyncs`, a ``TorchDispatchMode``, counts those ops whichever device the tensors
are on, so a CPU test shows where a CUDA run would stall (``torch.cuda.set_sync_debug_mode`` only
sees CUDA). ``ignore`` names host tensors read by design: the step counters of a non-fused
AdamW, which torch keeps on the CPU precisely so reading them costs no device sync.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
          aten._unique2.default, aten.equal.default}


class HostSyncs(TorchDispatchMode):
    """Inside ``with HostSyncs() as syncs``: ``syncs.ops`` lists every host read by op name."""

    def __init__(self, ignore: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._ignore = {t.data_ptr() for t in ignore}
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is not None and first.data_ptr() not in self._ignore and _reads(func, first,
                                                                                kwargs):
            self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **kwargs)

    @property
    def count(self) -> int:
        return len(self.ops)


def _reads(func: Any, first: torch.Tensor, kwargs: dict) -> bool:
    if func in _READS:
        return True
    to_host = func is aten._to_copy.default and str(kwargs.get("device", "")) == "cpu"
    return to_host and first.device.type != "cpu"


def optimizer_step_counters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The ``step`` tensors of ``optimizer``'s state (host tensors unless fused/capturable)."""
    return [s["step"] for s in optimizer.state.values() if isinstance(s.get("step"),
                                                                        torch.Tensor)]
