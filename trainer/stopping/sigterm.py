"""SIGTERM (the launcher stopping a job, Slurm preemption, `scancel`): finish the step, agree
on it, save a checkpoint, exit 143 (adapter: signals, a thread, MPI).

`install` (at the start of the training loop) catches SIGTERM. A Python handler runs only when
the main thread comes back to the interpreter, which a rank blocked inside an MPI or NCCL call
never does; so the handler also writes to a wakeup pipe (`signal.set_wakeup_fd`) read by a
thread, which notes the request at once and arms a watchdog. The loop asks `after(step)` at the
end of every step; the ranks agree on the step with `trainer.stopping.agreement` (a late vote,
`trainer.comm.mpi.vote`, over a duplicate of the MPI communicator of the ranks that train, so
the job's own communicators and their progress records are untouched). Once they agree, the
watchdog is disarmed and the run saves its checkpoint as after a last step (a save still being
written in the background is finished first: `trainer.checkpoint.writer`), then exits 143
(`trainer.train`). When they cannot agree in time (`agreement.reach_seconds`: a rank died and
the others are stuck in a collective with it), the watchdog ends the rank with 143 at once,
without a checkpoint: the launcher's grace would only be waited out, and a restart resumes from
the last committed one.

The grace is the launcher's (``DTRAIN_GRACE_S``, `workerenv`; 10 s, dtrain's default, when
not launched by dtrain): the save must fit in what is left of it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any

import workerenv
from trainer.comm.mpi.vote import LateMax
from trainer.stopping.agreement import StopAgreement, reach_seconds

EXIT_CODE = 128 + signal.SIGTERM
DEFAULT_GRACE_S = 10.0


class SigtermStop:
    def __init__(self, vote: LateMax | None, rank: int, grace: float) -> None:
        self.agreement = StopAgreement(vote)
        self._vote, self.rank, self.grace = vote, rank, grace
        self.requested = threading.Event()
        self.stopped_at: int | None = None  # the step every rank stopped after
        self._agreed = threading.Event()
        self._armed = False  # the watchdog runs (the watcher thread's own flag)
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="sigterm", daemon=True).start()

    def after(self, step: int) -> bool:
        """At the end of ``step`` on every rank: True when every rank stops after it."""
        if self.agreement.after(step, self.requested.is_set()):
            self.stopped_at = step
            self._agreed.set()
            return True
        return False

    def close(self, *, clean: bool) -> None:
        """Restore SIGTERM; ``clean``: training ended on every rank alike (the pending vote
        and the vote's communicator are collective), not by an error on this one."""
        signal.set_wakeup_fd(self._previous_fd)
        signal.signal(signal.SIGTERM, self._previous)
        self._agreed.set()  # the watchdog has nothing left to guard
        if clean and self._vote is not None:
            self.agreement.finish()
            self._vote.close()
        os.close(self._write_fd)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested.set()

    def _watch(self) -> None:
        """Wakes on every signal the process handles; on SIGTERM, guards the agreement."""
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            if not data:
                os.close(self._read_fd)
                return
            if signal.SIGTERM in data and not self._armed:
                self._armed = True
                self.requested.set()
                wait = reach_seconds(self.agreement.longest, self.grace)
                if not self._agreed.wait(wait):
                    if self.rank == 0:  # said once (when rank 0 is among those left)
                        print(f"dtrain: SIGTERM, and the ranks did not agree on a step within "
                              f"{wait:.1f}s (a rank is gone or stuck): leaving without a "
                              "checkpoint", file=sys.stderr, flush=True)
                    os._exit(EXIT_CODE)


def install(mpi_comm: Any, size: int, rank: int,
            environ: Mapping[str, str] = os.environ) -> SigtermStop:
    """Catch SIGTERM for the training loop (collective over ``mpi_comm`` when ``size`` > 1:
    the vote's communicator is made here, on every rank that trains)."""
    grace = environ.get(workerenv.GRACE_S, "")
    try:
        seconds = float(grace) if grace else DEFAULT_GRACE_S
    except ValueError:
        seconds = DEFAULT_GRACE_S
    return SigtermStop(LateMax(mpi_comm) if size > 1 else None, rank, seconds)
