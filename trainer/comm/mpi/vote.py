"""A late vote: the MAX of one small integer over every rank, posted now and read later.

The training loop asks the ranks things they must answer alike, at the same step, without
stopping to talk: "was SIGTERM seen?" (`trainer.stopping.sigterm`), "is every rank's part of
the checkpoint written?" (`trainer.checkpoint.writer`). Each rank posts its value into a
non-blocking all-ranks MAX (``Iallreduce``) at the end of a step and reads the result one step
later, when it has long completed, so the question costs no latency.

The vote runs on a duplicate of the MPI communicator (``Dup``, collective), so it never mixes
with the job's own communicators and their progress records. Only the thread that runs the
training loop posts and reads votes: nothing here needs more than MPI_THREAD_FUNNELED (mpi4py
asks MPICH for MPI_THREAD_MULTIPLE anyway).
"""

from __future__ import annotations

import array
from typing import Any


class LateMax:
    """A non-blocking MAX of one integer in [0, 127] over a duplicate of ``mpi_comm``.

    `post` then `result`, in turn, on every rank in the same order; `close` (collective) frees
    the duplicate."""

    def __init__(self, mpi_comm: Any) -> None:
        from mpi4py import MPI

        self._max = MPI.MAX
        self.comm = mpi_comm.Dup()
        self._send, self._recv = array.array("b", [0]), array.array("b", [0])
        self._request: Any = None

    def post(self, value: int) -> None:
        self._send[0] = int(value)
        self._request = self.comm.Iallreduce(self._send, self._recv, op=self._max)

    def result(self) -> int:
        """The MAX of the values every rank posted last (waits for it if need be)."""
        self._request.Wait()
        self._request = None
        return int(self._recv[0])

    def close(self) -> None:
        self.comm.Free()
