"""A late vote: the MAX of one small integer over every rank, posted now and read later.

The training loop asks the ranks things they must answer alike, at the same step, without
stopping to talk: "was SIGTERM seen?" (`trainer.stopping.sigterm`), "is every rank's part of
the checkpoint written?" (`trainer.checkpoint.writer`). Each rank posts its value into a
non-blocking all-ranks MAX (``Iallreduce``) at the end of a step and reads the result one step
later, when it has long completed, so the question costs no latency.

The same late MAX carries a save's agreement (`trainer.training.checkpointing`: whether a weight
is not finite on any rank, AdamW's step count), several 64-bit integers at once (``width``).

The vote runs on a duplicate of the MPI communicator (``Dup``, collective), so it never mixes
with the job's own communicators and their progress records. Only the thread that runs the
training loop posts and reads votes: nothing here needs more than MPI_THREAD_FUNNELED (mpi4py
asks MPICH for MPI_THREAD_MULTIPLE anyway).
"""

from __future__ import annotations

import array
from typing import Any


class LateMax:
    """A non-blocking MAX of ``width`` 64-bit integers over a duplicate of ``mpi_comm``.

    `post` then `result` (or `results`), in turn, on every rank in the same order; `close`
    (collective) frees the duplicate."""

    def __init__(self, mpi_comm: Any, width: int = 1) -> None:
        from mpi4py import MPI

        self._max = MPI.MAX
        self.comm = mpi_comm.Dup()
        self._send, self._recv = array.array("q", [0] * width), array.array("q", [0] * width)
        self._request: Any = None

    def post(self, value: int, *more: int) -> None:
        """Post ``value`` (and ``more``: ``width`` values in all)."""
        values = [int(value), *(int(v) for v in more)]
        if len(values) != len(self._send):  # every rank must reduce as many values
            raise ValueError(f"posted {len(values)} values to a vote of {len(self._send)}")
        self._send[:] = array.array("q", values)
        self._request = self.comm.Iallreduce(self._send, self._recv, op=self._max)

    def result(self) -> int:
        """The MAX of the values every rank posted last (waits for it if need be)."""
        return self.results()[0]

    def results(self) -> list[int]:
        """Every value's MAX of the post before (waits for it if need be)."""
        self._request.Wait()
        self._request = None
        return list(self._recv)

    def close(self) -> None:
        self.comm.Free()
