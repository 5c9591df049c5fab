"""The checkpoint writer: at most one save in flight, written and committed in a background
thread while training goes on (``--async-save``), or in place.

A save is handed over once `trainer.checkpoint.save.start` returned (the state is staged: a
copy the training does not change). Its two local phases, `Save.write` (every rank's tensor
file) and `Save.commit` (the leader's index, meta, rename and commit record), run in a
thread that only writes files: it never communicates, so training's collectives and the
save never share a communicator or a thread. The collective phases (`Save.settle`,
`Save.finish`) run on the training thread, at the end of a step, once every rank's local
phase is done.

The leader's pruning after a background commit (`Save.prune_later`) runs in the same thread
right after it, outside the phase: the ranks see the save finished once it is committed,
without waiting for the deletes (unlinking a checkpoint's files took 2.7-3.5 ms of the
leader's CPU and 10-60 ms of wall time a save, profiled at dp 2 x tp 2 x pp 2 on 2 cores,
2026-11-29, and every step end until then still voted), and the next save's write, queued
behind it in the thread, starts after them. Its error becomes the error of the leader's next
phase, which every rank then raises (`_pruned`). A save waited for (in place, the last one)
prunes in its commit, so its error is agreed at its `Save.finish`.

Whether it is done is asked with a late vote (`trainer.comm.protocol.Vote`): at the end of
each step every rank posts ``BUSY`` while its thread still runs, else ``FAILED`` or ``DONE``,
and reads the MAX every rank posted one step earlier. Every rank reads the same MAX at the same
step, so all move on at the same step, and the question costs one tiny non-blocking collective
per step while a save is in flight. The vote also answers what the collective phases would
ask: when every rank posted ``DONE``, every write (or the commit) succeeded, so `Save.settle`
and `Save.finish` need no collective of their own (the records reach the leader through the
folder, `Save.write`); those collectives were most of what a step end waited for while a save
was in flight (profiled at dp 2 x tp 2 x pp 2, 8 ranks on 2 cores: four rounds, 7-17 ms at a
time). When any rank posted ``FAILED``, the collective phase agrees on the error as in place:
it is raised on every rank at once, one error at the end of a later step, never lost.

`wait` (the next save, the last one, SIGTERM's) finishes the save in flight; `abandon` (an
error on this rank) only lets the thread finish what it is writing, so a commit record is
never torn: a folder without its marker is never taken for a checkpoint, and the next save
prunes it.

The background thread is started once, with the writer, and waits for its phases: starting a
thread per phase made the training thread wait until the new thread was first scheduled
(`threading.Thread.start`), a scheduling round over every process that shares the cores
(profiled at dp 2 x tp 2 x pp 2, 8 ranks on 2 cores: 2-17 ms of a background save's 8-25 ms
blocked); handing a phase to a waiting thread is a queue put.

The background thread runs at a lower priority than the training threads (`WRITER_NICE`):
where the ranks use every core, a write that competes with them for the CPU (its checksums and
the copy into aligned buffers) would stretch every step it overlaps; at a lower priority it
takes the cycles the step leaves (waits on memory, on I/O, between collectives) and still gets
a share when the step holds every core, so it never starves. What it runs in Python, holding
the interpreter's lock, is kept short: a training thread that wants the lock while this thread
holds it waits until this low-priority thread is scheduled again. The staged copy is one call
(`Save.copy`), and a file's header and runs are worked out once per run, not per save
(`trainer.checkpoint.files.Images`); the rest is system calls and hashing, which let the lock
go (profiled at dp 2 x tp 2 x pp 2, 2026-11-29: 1.7 ms of CPU per rank and save, from 2.2).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from trainer.checkpoint.layout import CheckpointError
from trainer.checkpoint.save import Save
from trainer.comm.protocol import Vote

WRITER_NICE = 10
"""How much nicer the background thread is than training (Linux: per thread): ~10% of a core
against a training thread when they share it (CFS weights 110 vs 1024 at nice 10 vs 0), all
of it when the core is idle."""

DONE, FAILED, BUSY = 0, 1, 2
"""What a rank posts: its local phase succeeded, failed, or still runs (the MAX: BUSY while any
rank runs; once none does, FAILED when any failed)."""


class Writer:
    def __init__(self, vote: Vote | None, *, background: bool) -> None:
        """``vote``: over every rank of the save's group (None: one rank alone, which looks at
        its own thread); ``background``: write while training goes on (else in place)."""
        self.vote, self.background = vote, background
        self.save: Save | None = None  # in flight
        self._committing = False  # its phase: write, then commit
        self._phase: Future[None] | None = None  # the local phase running in the thread
        self._error: CheckpointError | None = None
        self._posted = False  # a vote posted and not read yet
        self._thread: ThreadPoolExecutor | None = None
        self._prune_error: CheckpointError | None = None  # of a pruning after a commit
        if background:  # started now (it lowers its own priority), not at the first save
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer",
                                              initializer=_lower_priority)
            self._thread.submit(lambda: None).result()

    def submit(self, save: Save) -> None:
        """Write ``save`` (in flight until `poll` or `wait` finishes it). Call `wait` first:
        one save at a time."""
        if self.save is not None:
            raise RuntimeError("a checkpoint is still in flight: wait() for it first")
        save.prune_later = save.prune_later and self._thread is not None
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
            verdict = self.vote.result()
            if verdict != BUSY:
                finished = self._advance(failed=verdict == FAILED)
                if finished is not None:
                    return finished
        self.vote.post(BUSY if self._busy() else FAILED if self._error else DONE)
        self._posted = True
        return None

    def wait(self) -> Save | None:
        """Collective: finish the save in flight, blocking; it (None when there was none)."""
        if self._posted and self.vote is not None:
            self.vote.result()  # every rank posted it: read it, so none is left behind
        self._posted = False
        finished = None
        while self.save is not None:
            self.join()
            finished = self._advance()
        return finished

    def join(self) -> None:
        """Wait for this rank's local phase in flight, if any (no collective)."""
        if self._phase is not None:
            self._phase.result()

    def abandon(self) -> None:
        """On an error of this rank (no collective): let the thread finish what it writes."""
        self.join()
        self.save, self._phase = None, None

    def close(self) -> None:
        """Let the background thread go, once it finished what it writes."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def _busy(self) -> bool:
        return self._phase is not None and not self._phase.done()

    def _run(self, save: Save, phase: Callable[[], Any], *, here: bool = False) -> None:
        """Run a local phase of ``save`` (in a thread, or here: in place, or ``here``); its
        error is kept."""

        def body() -> None:
            self._error = self._pruned() or save.attempt(phase)
            if save.prunable and save.prune_later and self._thread is not None:
                # After the commit, in this thread but not in its phase: the ranks see the
                # save finished without waiting for the deletes (`Save.prune_later`); the next
                # phase queued here (the next save's write) runs after them.
                self._thread.submit(self._prune, save)

        self._error, self._phase = None, None
        if self._thread is not None and not here:  # in place, the training thread keeps its
            # priority
            self._phase = self._thread.submit(body)
        else:
            body()

    def _prune(self, save: Save) -> None:
        """The pruning after ``save``'s commit (the background thread, the leader); its error
        is the error of this rank's next phase (`_pruned`), which every rank then raises."""
        error = save.attempt(save.prune)
        if error is not None:
            self._prune_error = error

    def _pruned(self) -> CheckpointError | None:
        """The error of the last pruning, once (the background thread)."""
        error, self._prune_error = self._prune_error, None
        return error

    def _advance(self, failed: bool | None = None) -> Save | None:
        """Every rank's local phase is over: the collective phase after it (raises the
        save's error on every rank); the save once finished. ``failed``: what the vote said
        (None: no vote said it, the phase asks collectively)."""
        save, error = self.save, self._error
        if save is None:
            return None
        self._phase = None
        try:
            if not self._committing:
                save.settle(error, failed)
                self._committing = True
                # Only the leader commits: elsewhere the phase does nothing worth waking
                # the thread for (a scheduling round where the ranks hold every core).
                self._run(save, save.commit, here=not save.leader)
                return None
            save.finish(error, failed)
        except BaseException:
            self.save = None
            raise
        self.save = None
        return save


def _lower_priority() -> None:
    """This thread (not the process) `WRITER_NICE` below the thread that started it (run once,
    by the background thread as it starts): Linux
    keeps a nice value per thread (a new thread starts with its creator's), and lowering one's
    own never needs a privilege. Elsewhere, or refused, the thread runs as is."""
    try:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, min(os.getpriority(os.PRIO_PROCESS, me) + WRITER_NICE,
                                                19))
    except (AttributeError, OSError):
        pass
