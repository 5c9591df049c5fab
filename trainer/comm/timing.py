"""Communication time of a training step, for DP, TP and PP alike: exposed and total.

`TimedCommunicator` wraps a group's communicator and reports every operation to the step's
`CommClock`:

* the operation's interval, from the call to its observed completion (a blocking call's return;
  for an async handle, ``wait()`` returning or ``is_completed()`` first answering True; a
  ``batch_p2p`` is one operation, complete when all of its handles are);
* a *blocked* interval when the calling thread is the step's thread and it is stuck on
  communication: a blocking call, or, with ``handles_block``, a handle from the first
  ``wait()``/``is_completed()`` to its completion. TP and PP only touch a handle when they
  have nothing else to do (the pipeline's p2p waits), so theirs block; DP polls its handles
  during backward to drive MPI progress, so its communicator is wrapped with
  ``handles_block=False`` and the step marks its wait with ``CommClock.blocked()`` around
  ``finish_grad_sync``.

Per step (`CommClock.take`): **exposed** = the length of the union of the blocked intervals
(time the step waited on communication); **hidden** = the part of every operation's interval
outside that union (communication that overlapped compute, e.g. DP buckets during backward);
**total** = exposed + hidden. So total >= exposed by construction, total = exposed when nothing
overlaps (TP's blocking all-reduces), and compute = step - exposed. A backend whose async
operations finish on the device (NCCL) is seen from the host: in flight until the host waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from trainer.comm.mesh import Mesh
from trainer.comm.protocol import Communicator, Handle, P2POp, ReduceOp
from trainer.comm.topology import SPANS

Interval = tuple[float, float]


def union(intervals: Sequence[Interval]) -> list[Interval]:
    """Disjoint, sorted intervals covering exactly the given ones."""
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def outside(interval: Interval, covered: Sequence[Interval]) -> float:
    """Length of ``interval`` not covered by the disjoint ``covered`` intervals."""
    start, end = interval
    inside = sum(max(0.0, min(end, e) - max(start, s)) for s, e in covered)
    return (end - start) - inside


class CommClock:
    """Operation and blocked intervals of one rank since the last `take`."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now
        self._owner = threading.get_ident()
        self._ops: list[Interval] = []
        self._blocked: list[Interval] = []

    def op(self, start: float, end: float) -> None:
        self._ops.append((start, end))  # list.append is atomic: DP's comm thread reports too

    def block(self, start: float, end: float) -> None:
        """The step's thread waited on communication from ``start`` to ``end`` (other threads'
        waits are not the step's)."""
        if threading.get_ident() == self._owner:
            self._blocked.append((start, end))

    @contextmanager
    def blocked(self) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.block(start, self.now())

    def take(self) -> tuple[float, float]:
        """(exposed, total) seconds since the last call, and start over."""
        ops, self._ops = self._ops, []
        waits, self._blocked = union(self._blocked), []
        exposed = sum(end - start for start, end in waits)
        return exposed, exposed + sum(outside(op, waits) for op in ops)


class _Op:
    """One operation in flight: done when all of its ``pending`` handles are."""

    def __init__(self, clock: CommClock, start: float, pending: int) -> None:
        self.clock, self.start, self.pending = clock, start, pending

    def finished_one(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.clock.op(self.start, self.clock.now())


class TimedHandle:
    """A handle whose completion (and, when ``blocks``, whose waiting) is reported."""

    def __init__(self, inner: Handle, op: _Op, *, blocks: bool) -> None:
        self.inner, self._op, self._blocks = inner, op, blocks
        self._waiting_since: float | None = None
        self._done = False

    def wait(self) -> None:
        self._touch()
        self.inner.wait()
        self._finish()

    def is_completed(self) -> bool:
        self._touch()
        test = getattr(self.inner, "is_completed", None)
        if test is None:
            self.inner.wait()  # a handle without a test (an empty batch) is already done
        elif not test():
            return False
        self._finish()
        return True

    def _touch(self) -> None:
        if self._waiting_since is None:
            self._waiting_since = self._op.clock.now()

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        if self._blocks and self._waiting_since is not None:
            self._op.clock.block(self._waiting_since, self._op.clock.now())
        self._op.finished_one()


class TimedCommunicator:
    """Delegates every operation to ``inner`` and reports it to ``clock`` (module docstring)."""

    def __init__(self, inner: Communicator, clock: CommClock, *,
                 handles_block: bool = True) -> None:
        self.inner, self.clock, self.handles_block = inner, clock, handles_block

    rank = property(lambda self: self.inner.rank)
    size = property(lambda self: self.inner.size)
    name = property(lambda self: self.inner.name)
    backend = property(lambda self: self.inner.backend)

    def _run(self, call: Callable[[], Handle | None]) -> Handle | None:
        start = self.clock.now()
        result = call()
        if result is None:  # a blocking call: done, and the caller waited all along
            end = self.clock.now()
            self.clock.op(start, end)
            self.clock.block(start, end)
            return None
        return self._timed(start, [result])[0]

    def _timed(self, start: float, handles: list[Handle]) -> list[Handle]:
        op = _Op(self.clock, start, len(handles))
        timed: list[Handle] = [TimedHandle(h, op, blocks=self.handles_block) for h in handles]
        if not timed:
            self.clock.op(start, self.clock.now())
        return timed

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False) -> Handle | None:
        return self._run(lambda: self.inner.all_reduce(t, op, async_op=async_op))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *,
                   async_op: bool = False) -> Handle | None:
        return self._run(lambda: self.inner.all_gather(out, inp, async_op=async_op))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor,
                       op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False) -> Handle | None:
        return self._run(lambda: self.inner.reduce_scatter(out, inp, op, async_op=async_op))

    def broadcast(self, t: torch.Tensor, src: int, *, async_op: bool = False) -> Handle | None:
        return self._run(lambda: self.inner.broadcast(t, src, async_op=async_op))

    def send(self, t: torch.Tensor, dst: int) -> None:
        self._run(lambda: self.inner.send(t, dst))

    def recv(self, t: torch.Tensor, src: int) -> None:
        self._run(lambda: self.inner.recv(t, src))

    def batch_p2p(self, ops: Sequence[P2POp]) -> list[Handle]:
        start = self.clock.now()
        return self._timed(start, self.inner.batch_p2p(ops))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, *,
                   in_splits: Sequence[int] | None = None,
                   out_splits: Sequence[int] | None = None,
                   async_op: bool = False) -> Handle | None:
        return self._run(lambda: self.inner.all_to_all(
            out, inp, in_splits=in_splits, out_splits=out_splits, async_op=async_op))

    def barrier(self) -> None:
        self._run(self.inner.barrier)

    def split(self, color: int, key: int, *, name: str = "") -> Communicator:
        """The sub-group, timed on the same clock (e.g. the pipeline's embedding group)."""
        return TimedCommunicator(self.inner.split(color, key, name=name), self.clock,
                                 handles_block=self.handles_block)


def timed_mesh(mesh: Mesh, clock: CommClock) -> Mesh:
    """Every group of ``mesh`` timed on ``clock``. The handles of the groups inside dp (those a
    `DataParallel` reduces over, `trainer.parallel.data.split`) are polled during backward, so
    they do not count as blocking. The gradients' groups take cp in (``dp_cp``), the cp group
    alone is the ring attention's, whose waits block."""
    inside_dp, dp = set(SPANS["dp_cp"]), set(SPANS["dp"])
    return mesh.wrapped(lambda axes, comm: TimedCommunicator(
        comm, clock, handles_block=not (set(axes) <= inside_dp and set(axes) & dp)))
