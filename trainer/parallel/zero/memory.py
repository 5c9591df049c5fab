"""Memory accounting: what a rank should hold for its parameters, gradients and optimizer
state, what it does hold, and its peak memory per step.

The expected bytes follow Megatron's bytes-per-parameter table (distributed optimizer docs;
ZeRO paper §3) for the parameters a rank holds (its TP x PP shard), d = dp:

    precision  parameters  gradients  optimizer                      zero 0  zero 1    zero 2
    fp32       4           4          8  (Adam m, v)                 16      8 + 8/d   4 + 12/d
    bf16       2           4          12 (fp32 main weights + m, v)  18      6 + 12/d  2 + 16/d

and ``--zero 3`` (fp32 only so far) 16/d: everything sharded (a mixture of experts' experts
over their expert-data-parallel group, d = dp / ep for them); during a step the gathered
units and their staged gradients come on top (`zero3_on_top`: the root and prefetch + 1
blocks; `trainer.parallel.zero.units` ``peak_gathered_bytes``, held to it by
tests/trainer/test_zero3_memory.py).

Under fp32 the AdamW of ``--zero 1`` steps views of the parameters, so it holds no main copy;
the gradient buffer stays whole (ZeRO-1 shards the optimizer only), padded by < dp elements per
bucket. ZeRO-2 holds 1/d of that buffer (`trainer.parallel.zero.grad_shards`), plus, during backward
only, the buckets being filled or reduced (its ``peak_staged_bytes``). `held_bytes` measures
the tensors themselves (distinct storages), so a test can hold the table to what a run
allocates. `PeakMemory` is the metrics file's ``peak_mem_bytes``: CUDA's
max allocated on a GPU, else the process's peak resident set size (VmHWM, reset every step
through /proc/self/clear_refs where the kernel allows it, else the peak since start).
"""

from __future__ import annotations

import resource
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

MIB = 2**20


@dataclass(frozen=True)
class MemoryTable:
    """Bytes of one rank, by kind."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def __add__(self, other: MemoryTable) -> MemoryTable:
        return MemoryTable(self.params + other.params, self.grads + other.grads,
                           self.optimizer + other.optimizer)


def expected_bytes(n_params: int, *, bf16: bool, zero: int, dp: int, experts: int = 0,
                   experts_over: int = 0) -> MemoryTable:
    """The table above for ``n_params`` parameters on one rank. ``experts`` of them (a mixture
    of experts' on this rank) have copies on their expert-data-parallel group only,
    ``experts_over`` = dp / ep ranks, and are sharded over those (`trainer.parallel.zero.split`):
    d = ``experts_over`` for them."""
    return (_sharded(n_params - experts, bf16=bf16, zero=zero, d=dp)
            + _sharded(experts, bf16=bf16, zero=zero, d=experts_over or dp))


def _sharded(n: int, *, bf16: bool, zero: int, d: int) -> MemoryTable:
    optimizer = (12 if bf16 else 8) * n / (d if zero else 1)
    grads = 4 * n / (d if zero >= 2 else 1)
    params = (2 if bf16 else 4) * n / (d if zero >= 3 else 1)
    return MemoryTable(params=round(params), grads=round(grads), optimizer=round(optimizer))


def zero3_on_top(*, root: int, block: int, prefetch: int, in_flight: int, bf16: bool
                 ) -> MemoryTable:
    """What a ZeRO-3 rank holds at most during a step on top of its shards, for units of
    ``root`` and ``block`` parameters: the root (gathered through forward and backward) and
    ``prefetch`` + 1 blocks gathered (the one computing and those fetched ahead), and the
    gradients of ``in_flight`` + 1 blocks staged (the one filling and the reduce-scatters in
    flight: the prefetch depth when they overlap backward, `trainer.parallel.zero.units`, else
    0, each waited for at its launch)."""
    return MemoryTable(params=(2 if bf16 else 4) * (root + (prefetch + 1) * block),
                       grads=4 * (in_flight + 1) * block, optimizer=0)


def held_bytes(params: Iterable[torch.Tensor], grads: torch.Tensor | Iterable[torch.Tensor],
               optimizer: torch.optim.Optimizer) -> MemoryTable:
    """What a rank holds: its parameters, its gradient buffer (or every group's buffers, a
    gradient sync's ``buffers``), and the optimizer's main parameters (those not sharing the
    model parameters' memory) and state tensors."""
    params = list(params)
    grads = [grads] if isinstance(grads, torch.Tensor) else list(grads)
    model = {p.untyped_storage().data_ptr() for p in params}
    stepped = [p for g in optimizer.param_groups for p in g["params"]]
    mains = [p for p in stepped if p.untyped_storage().data_ptr() not in model]
    states = [t for s in optimizer.state.values() for t in s.values()
              if isinstance(t, torch.Tensor) and t.numel() > 1]
    return MemoryTable(params=_bytes(params), grads=_bytes(grads),
                       optimizer=_bytes(mains) + _bytes(states))


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
    return sum(seen.values())


def describe(n_params: int, *, bf16: bool, zero: int, dp: int, where: str, experts: int = 0,
             experts_over: int = 0) -> str:
    """The start-up line: the expected bytes per rank and the rule they come from
    (``experts`` and ``experts_over`` as in `expected_bytes`)."""
    t = expected_bytes(n_params, bf16=bf16, zero=zero, dp=dp, experts=experts,
                       experts_over=experts_over)
    rule = _rule(bf16=bf16, zero=zero, d=dp)
    if experts:
        rule += f"; the {experts:,} experts' {_rule(bf16=bf16, zero=zero, d=experts_over or dp)}"
    # KiB below a MiB, so a small model's line still tells the rules apart.
    unit, size = ("MiB", MIB) if t.total >= MIB else ("KiB", 1024)
    return (f"dtrain: memory per rank ({where}, {n_params:,} parameters, "
            f"{'bf16' if bf16 else 'fp32'}, zero {zero}, dp {dp}): parameters "
            f"{t.params / size:.1f} {unit} + gradients {t.grads / size:.1f} {unit} + optimizer "
            f"{t.optimizer / size:.1f} {unit} = {t.total / size:.1f} {unit} ({rule} bytes per "
            "parameter)")


def _rule(*, bf16: bool, zero: int, d: int) -> str:
    return {0: "18" if bf16 else "16", 1: f"6 + 12/{d}" if bf16 else f"8 + 8/{d}",
            2: f"2 + 16/{d}" if bf16 else f"4 + 12/{d}", 3: f"16/{d}"}[zero]


class PeakMemory:
    """Peak memory of this process since the previous `take` (bytes)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._resettable = Path("/proc/self/clear_refs").exists()
        self.take()

    def take(self) -> int:
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak
        peak = _vm_hwm()
        if self._resettable:
            try:  # "5" resets the peak RSS (Linux >= 4.0, proc(5))
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                self._resettable = False
        return peak


def _vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class SavedTensorMeter:
    """Peak bytes of the tensors autograd saves for backward, each storage once (install with
    ``torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack)``). Storages are told
    apart by their implementation, so it counts fake and meta tensors too (`trainer.plan`).
    ``weights``: storages of the model's parameters, which a matrix product saves; their bytes
    are also kept apart (``weight_bytes``: live at the peak), as they do not grow with the
    microbatches in flight."""

    def __init__(self, weights: frozenset[int] = frozenset()) -> None:
        self.live: dict[int, int] = {}
        self.count: dict[int, int] = {}
        self.peak = 0
        self.weights = weights
        self.weight_bytes = 0

    def pack(self, t: torch.Tensor) -> _Saved:
        key = t.untyped_storage()._cdata
        self.count[key] = self.count.get(key, 0) + 1
        self.live[key] = max(self.live.get(key, 0), t.untyped_storage().nbytes())
        self.peak = max(self.peak, sum(self.live.values()))
        self.weight_bytes = sum(n for k, n in self.live.items() if k in self.weights)
        return _Saved(t, key, self)

    @staticmethod
    def unpack(saved: _Saved) -> torch.Tensor:
        return saved.t

    def release(self, key: int) -> None:
        self.count[key] -= 1
        if not self.count[key]:
            del self.count[key], self.live[key]


class _Saved:
    """A saved tensor whose release the meter hears of."""

    def __init__(self, t: torch.Tensor, key: int, meter: SavedTensorMeter) -> None:
        self.t, self.key, self.meter = t, key, meter

    def __del__(self) -> None:
        self.meter.release(self.key)
