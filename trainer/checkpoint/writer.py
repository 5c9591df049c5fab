"""The checkpoint writer: at most one save in flight, written and committed in a background
thread while training goes on (``--async-save``), or in place.

A save is handed over once `trainer.checkpoint.save.start` returned (the state is staged: a
copy the training does not change). Its two local phases, `Save.write` (every rank's tensor
file) and `Save.commit` (the leader's index, meta, rename, commit record and pruning), run in a
thread that only writes files: it never communicates, so training's collectives and the
save never share a communicator or a thread. The collective phases (`Save.settle`,
`Save.finish`) run on the training thread, at the end of a step, once every rank's local
phase is done.

Whether it is done is asked with a late vote (`trainer.comm.protocol.Vote`): at the end of
each step every rank posts ``BUSY`` while its thread still runs and reads the MAX every rank
posted one step earlier. Every rank reads the same MAX at the same step, so all move on at the
same step, and the question costs one tiny non-blocking collective per step while a save is in
flight. A failure in the thread is kept and raised by `Save.settle` or `Save.finish` on every
rank at once: one error at the end of a later step, never lost.

`wait` (the next save, the last one, SIGTERM's) finishes the save in flight; `abandon` (an
error on this rank) only lets the thread finish what it is writing, so a commit record is
never torn: a folder without its marker is never taken for a checkpoint, and the next save
prunes it.

The background thread runs at a lower priority than the training threads (`WRITER_NICE`):
where the ranks use every core, a write that competes with them for the CPU (its checksums and
the copy into aligned buffers) would stretch every step it overlaps; at a lower priority it
takes the cycles the step leaves (waits on memory, on I/O, between collectives) and still gets
a share when the step holds every core, so it never starves.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from trainer.checkpoint.layout import CheckpointError
from trainer.checkpoint.save import Save
from trainer.comm.protocol import Vote

WRITER_NICE = 10
"""How much nicer the background thread is than training (Linux: per thread): ~10% of a core
against a training thread when they share it (CFS weights 110 vs 1024 at nice 10 vs 0), all
of it when the core is idle."""

DONE, BUSY = 0, 1
"""What a rank posts: its local phase is over (succeeded or failed), or still running."""


class Writer:
    def __init__(self, vote: Vote | None, *, background: bool) -> None:
        """``vote``: over every rank of the save's group (None: one rank alone, which looks at
        its own thread); ``background``: write while training goes on (else in place)."""
        self.vote, self.background = vote, background
        self.save: Save | None = None  # in flight
        self._committing = False  # its phase: write, then commit
        self._thread: threading.Thread | None = None
        self._error: CheckpointError | None = None
        self._posted = False  # a vote posted and not read yet

    def submit(self, save: Save) -> None:
        """Write ``save`` (in flight until `poll` or `wait` finishes it). Call `wait` first:
        one save at a time."""
        if self.save is not None:
            raise RuntimeError("a checkpoint is still in flight: wait() for it first")
        self.save, self._committing = save, False
        self._run(save, save.write)

    def poll(self) -> Save | None:
        """At the end of every step, on every rank alike: move the save in flight on when every
        rank's part is done; the save that finished (its error raised on every rank)."""
        if self.save is None:
            return None
        if self.vote is None:
            return None if self._busy() else self._advance()
        if self._posted:
            self._posted = False
            if self.vote.result() == DONE:
                finished = self._advance()
                if finished is not None:
                    return finished
        self.vote.post(BUSY if self._busy() else DONE)
        self._posted = True
        return None

    def wait(self) -> Save | None:
        """Collective: finish the save in flight, blocking; it (None when there was none)."""
        if self._posted and self.vote is not None:
            self.vote.result()  # every rank posted it: read it, so none is left behind
        self._posted = False
        finished = None
        while self.save is not None:
            if self._thread is not None:
                self._thread.join()
            finished = self._advance()
        return finished

    def abandon(self) -> None:
        """On an error of this rank (no collective): let the thread finish what it writes."""
        if self._thread is not None:
            self._thread.join()
        self.save, self._thread = None, None

    def _busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self, save: Save, phase: Callable[[], Any]) -> None:
        """Run a local phase of ``save`` (in a thread, or here); its error is kept."""

        def body() -> None:
            self._error = save.attempt(phase)

        def background() -> None:
            _lower_priority()  # this thread's own; in place, the training thread keeps its own
            body()

        self._error, self._thread = None, None
        if self.background:
            self._thread = threading.Thread(target=background, name=f"checkpoint-{save.step}",
                                            daemon=True)
            self._thread.start()
        else:
            body()

    def _advance(self) -> Save | None:
        """Every rank's local phase is over: the collective phase after it (raises the
        save's error on every rank); the save once finished."""
        save, error = self.save, self._error
        if save is None:
            return None
        self._thread = None
        try:
            if not self._committing:
                save.settle(error)
                self._committing = True
                self._run(save, save.commit)
                return None
            save.finish(error)
        except BaseException:
            self.save = None
            raise
        self.save = None
        return save


def _lower_priority() -> None:
    """This thread (not the process) `WRITER_NICE` below the thread that started it: Linux
    keeps a nice value per thread (a new thread starts with its creator's), and lowering one's
    own never needs a privilege. Elsewhere, or refused, the thread runs as is."""
    try:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, min(os.getpriority(os.PRIO_PROCESS, me) + WRITER_NICE,
                                                19))
    except (AttributeError, OSError):
        pass
