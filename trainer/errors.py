"""The trainer's exceptions: one hierarchy, one message shape.

Every message reads ``<what failed> [<where>]: <why>. <how to fix>``: the base, `DtrainError`,
lives in the contract module the launcher and the trainer share (``workerenv.py``). ``where``
names a rank, a communicator, an option or a file.

An error that every rank raises at the same point, from a value they all agree on, is marked
with `TrainerError.everywhere`: no rank is left waiting in a collective, so the job ends without
an MPI abort and only the rank chosen to report prints it (once, not once per rank).
"""

from __future__ import annotations

from workerenv import DtrainError


class TrainerError(DtrainError):
    """Base of every error the trainer reports to a user."""

    def __init__(self, what: str, where: str, why: str, fix: str = "") -> None:
        super().__init__(what, where, why, fix)
        self.agreed, self.report = False, True

    def everywhere(self, *, report: bool) -> TrainerError:
        """This error, marked as raised by every rank together; only ``report`` ranks print it."""
        self.agreed, self.report = True, report
        return self


class BootstrapError(TrainerError):
    """The process could not join the job: MPI world, worker contract or device mismatch."""


class TopologyError(TrainerError):
    """A parallel layout (dp, tp, pp) does not fit the world or names a rank outside it."""


class CommError(TrainerError):
    """A collective or point-to-point call got arguments it cannot honour."""


class ConfigError(TrainerError):
    """A trainer option or combination of options is wrong."""


class MemoryBudgetError(TrainerError):
    """A rank would hold, or held, more than ``--memory-budget`` allows."""
