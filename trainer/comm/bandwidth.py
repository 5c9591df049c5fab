"""All-reduce bandwidth as nccl-tests reports it, for any `Communicator`.

algbw = bytes / time; busbw = algbw * 2(n-1)/n, the per-link traffic of a ring all-reduce, so
numbers are comparable across group sizes and with nccl-tests' ``all_reduce_perf``. The time of
one sample is the slowest rank's (an all-reduce is only as fast as its last member).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from trainer.comm.protocol import Communicator, ReduceOp
from trainer.errors import ConfigError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"64K"``, ``"16M"``, ``"1G"`` or a plain byte count."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("B") if text else ""
    unit = raw[-1:] if raw[-1:] in _UNITS else ""
    number = raw[: len(raw) - len(unit)]
    if not number.isdigit() or int(number) <= 0:
        raise ConfigError(
            "invalid message size", repr(text), "expected a positive number with K, M or G",
            "Write sizes like 1K,64K,16M",
        )
    return int(number) * _UNITS[unit]


def parse_sizes(text: str) -> list[int]:
    return [parse_size(part) for part in text.split(",") if part.strip()]


def format_size(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return f"{nbytes}B"


def bus_factor(ranks: int) -> float:
    return 2 * (ranks - 1) / ranks


@dataclass(frozen=True)
class Sample:
    """One message size on one communicator: seconds per all-reduce and the two bandwidths."""

    nbytes: int
    ranks: int
    seconds: float
    algbw_gbps: float
    busbw_gbps: float

    @classmethod
    def of(cls, nbytes: int, ranks: int, seconds: float) -> Sample:
        algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        return cls(nbytes, ranks, seconds, algbw, algbw * bus_factor(ranks))


def measure_allreduce(
    comm: Communicator,
    nbytes: int,
    *,
    device: torch.device,
    iters: int = 10,
    warmup: int = 2,
) -> Sample:
    """Time ``iters`` fp32 SUM all-reduces of ``nbytes`` on ``comm`` (collective)."""
    # Zeros: a sum of ones would overflow to inf after enough iterations on many ranks.
    t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    for _ in range(warmup):
        comm.all_reduce(t)
    _sync(device)
    comm.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        comm.all_reduce(t)
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64,
                           device=device)
    comm.all_reduce(elapsed, ReduceOp.MAX)
    return Sample.of(t.numel() * 4, comm.size, float(elapsed.item()))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
