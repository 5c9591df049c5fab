"""The pieces of data parallelism below the `DataParallel` class: how the gradient buffer is cut
into buckets, a bucket's state while it is reduced, and the comm thread's handle and policy.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from torch import nn

from trainer.comm.protocol import Handle


def plan_buckets(numels: Sequence[int], bucket_size: int) -> list[tuple[int, int, range]]:
    """Cut parameters (given in buffer order) into buckets: (start, end, parameter indices).

    A bucket is closed as soon as it holds >= ``bucket_size`` elements, so a parameter bigger
    than the bucket size gets a bucket of its own and no parameter straddles two buckets."""
    buckets, first, start, offset = [], 0, 0, 0
    for i, n in enumerate(numels):
        offset += n
        if offset - start >= bucket_size or i == len(numels) - 1:
            buckets.append((start, offset, range(first, i + 1)))
            first, start = i + 1, offset
    return buckets


def spare_cores(local_ranks: int | None = None, cores: int | None = None) -> int:
    """Cores of this host beyond one per local rank (negative: ranks share cores).
    ``local_ranks`` defaults to the launcher's count: LOCAL_WORLD_SIZE (dtrain launch,
    torchrun) or MPI_LOCALNRANKS (MPICH's mpiexec), else 1; ``cores`` to the cores this
    process may run on."""
    if local_ranks is None:
        raw = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("MPI_LOCALNRANKS") or "1"
        local_ranks = int(raw) if raw.isdigit() else 1
    if cores is None:
        cores = len(os.sched_getaffinity(0))
    return cores - local_ranks


Schedule = Literal["hooks", "thread", "sync"]
"""When DP reduces its buckets: ``hooks``, each bucket's nonblocking reduction posted from the
gradient hooks during backward; ``thread``, the same driven by a comm thread; ``sync``, every
bucket reduced after backward with blocking calls."""


def reduction_schedule(backend: str, local_ranks: int | None = None,
                       cores: int | None = None) -> Schedule:
    """DP's default `Schedule` on this host, the one rule `trainer.training.run`,
    `trainer.parallel.data.grad_sync.DataParallel` and `bench.ddp` follow.

    NCCL: ``hooks`` (the GPU reduces beside the compute). MPI with a core to spare beyond one
    per local rank (`spare_cores`): ``thread``, on that core. MPI without: ``sync``. There
    nothing runs beside the backward, as MPI reduces only on the ranks' own cores, in its
    calls; MPICH's nonblocking all-reduce costs 2-3x the CPU of its blocking one (25 buckets of
    4 MB at dp 2: 40-50 ms against 13-24 ms; the blocking one runs MPICH's shared-memory
    algorithms, the nonblocking one a generic schedule), and driving it from a thread on a
    rank's own core preempts the backward (`bench.ddp`, 2026-11-29, dp 2 on 2 cores: 1-8% more
    CPU per step than from the hooks, no shorter step). Measured on 2 cores, 25M parameters,
    2026-11-30: `bench.ddp` 0.73-0.80x DDP's step after backward against 0.87-0.92x from the
    hooks; whole training runs (median of 30 steps) 3-7% faster at dp 4, within the runs'
    spread at dp 2 and ZeRO-1, 2-3% at ZeRO-2 and ZeRO-3 (dp 2)."""
    if backend != "mpi":
        return "hooks"
    return "thread" if spare_cores(local_ranks, cores) > 0 else "sync"


def wants_quiet_waits(backend: str, local_ranks: int | None = None,
                      cores: int | None = None) -> bool:
    """Whether DP should wait for its reductions by polling them with short sleeps rather than
    MPI's blocking wait, which spins its core until the peers are done: only where ranks share
    cores (`spare_cores` < 0), whose peers need that core meanwhile (`bench.ddp`, CPU per step
    and rank, dp 4 on 2 cores, 3 runs under load: 98-114 ms spinning, 93-104 polling). With a
    core per rank the spin costs no one, and the sleeps would delay each step of the reduction
    (2026-11-30, dp 2 on 2 cores: exposed communication 2.2-2.5 ms polling, 0.2 spinning)."""
    return backend == "mpi" and spare_cores(local_ranks, cores) < 0


class FutureHandle:
    """A `Handle` for an all-reduce running on the comm thread."""

    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result()  # re-raises the thread's exception here, on the main thread

    def is_completed(self) -> bool:
        return self._future.done()


class BucketState(Protocol):
    """What every gradient sync's buckets have: DP's `Bucket` and ZeRO-2/3's
    `trainer.parallel.zero.grad_shards.StagedBucket`."""

    @property
    def index(self) -> int: ...
    @property
    def params(self) -> list[nn.Parameter]: ...
    @property
    def ready(self) -> set[int]: ...
    @property
    def launched(self) -> bool: ...


@dataclass
class Bucket:
    index: int
    view: torch.Tensor
    params: list[nn.Parameter]
    ready: set[int] = field(default_factory=set)
    handle: Handle | None = None
    launched: bool = False
    wire: torch.Tensor | None = None
    """What is all-reduced when ``reduce_dtype`` is narrower than the buffer (else the view)."""
