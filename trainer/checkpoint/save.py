"""Writing a checkpoint in phases: every writer's tensor file into a temporary folder, the
leader's index, meta and RNG, rename, commit record, prune.

Every rank of the group (``world``) runs the phases together, in this order:

    start    collective (one all-reduce): the leader (rank 0 of the group) draws the temporary
             folder's name and creates it (`claim`), and takes its random state now (the
             step's); a caller may fold its own agreement into that collective (`opened`),
             or name the folder by a token agreed earlier and need no collective here
             (`trainer.training.checkpointing`)
    write    local I/O, any thread: the folder (when it does not exist yet: a save named by
             a token agreed earlier, `trainer.training.checkpointing`), this rank's tensor
             file (``rank-RRRRR.safetensors``, the slices it is the writer of; none when it
             writes nothing), hashed, fsynced (or left to the leader's commit,
             `Save.leader_syncs`); the leader's also ``rng.safetensors``
    settle   collective (one all-reduce): the ranks agree that every write succeeded, with
             the caller's own values folded in (`Save.checks`); after a late vote that said
             every write succeeded, nothing. Each rank left its record in the folder
             (`trainer.checkpoint.records`: no gather), and the leader goes on to commit
             once it has read them all, reading the agreement at `finish`
    commit   local I/O on the leader, any thread: ``index.json``, ``meta.json``, the rename
             into place, the commit record (the ``COMMITTED`` marker, last: size and checksum
             of every file; the order of what becomes durable: `trainer.checkpoint.commit`),
             then pruning (after the save's clock, `Save.report`; or left to the caller,
             `Save.prune_later`: the background writer prunes after the save finished)
    finish   collective: the ranks agree that the commit succeeded (after such a vote:
             nothing)

`save` runs them in a row; `trainer.checkpoint.writer` runs write and commit in a background
thread while training goes on. Every collective phase ends with an agreement, so a failure on
one rank fails every rank, without a hang, and the partial save is removed.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from trainer.checkpoint import checksum
from trainer.checkpoint.commit import RandomState, Records, commit_folder, rng_state
from trainer.checkpoint.failure import Posted, agree, conclude, discard, post, save_errors
from trainer.checkpoint.fault import fault
from trainer.checkpoint.files import FileRecord, Images, write_tensors
from trainer.checkpoint.layout import (
    RNG,
    CheckpointError,
    committed,
    rank_file,
)
from trainer.checkpoint.prune import prune
from trainer.checkpoint.rate import busy, report
from trainer.checkpoint.records import Gathering, leave
from trainer.comm.protocol import Communicator, ReduceOp

_COMMITTED, _FAILED = -1, -2  # what the leader broadcasts instead of a folder token


def save(root: Path, step: int, *, tensors: dict[str, torch.Tensor], contents: Any,
         meta: dict[str, Any], keep: int = 0, world: Communicator | None = None,
         device: torch.device | None = None) -> Path:
    """Write checkpoint ``step`` atomically, then prune to the newest ``keep`` (0 = keep all):
    every phase in a row (`start`'s arguments)."""
    job = start(root, step, tensors=tensors, contents=contents, meta=meta, keep=keep,
                world=world, device=device)
    if job is None:
        return root / f"step-{step}"
    job.settle(job.attempt(job.write))
    return job.finish(job.attempt(job.commit))


def start(root: Path, step: int, *, tensors: dict[str, torch.Tensor], contents: Any,
          meta: dict[str, Any], keep: int = 0, world: Communicator | None = None,
          device: torch.device | None = None) -> Save | None:
    """The first phase of saving checkpoint ``step`` (collective over ``world``; None: this
    process alone): the temporary folder exists when it returns. None when the step is already
    committed (a resumed run saving the step it resumed at): nobody writes.

    ``tensors``: this rank's tensor file (contiguous, on the CPU, a copy the training does not
    change; empty: none), ``contents``: what the index says about it, ``meta``: what
    ``meta.json`` holds besides the format, the step and Python's random state; ``device``:
    where the agreements' tensors live (the communicator's device)."""
    # `_Alone` answers every call a save makes of its group.
    group = cast(Communicator, _Alone()) if world is None else world
    device = device or torch.device("cpu")
    token, error = claim(root, step) if group.rank == 0 else (NOT_LEADER, None)
    agreed = torch.tensor([token], dtype=torch.int64, device=device)
    group.all_reduce(agreed, ReduceOp.MAX)  # the folder exists, or every rank learns why not
    return opened(root, step, int(agreed), error, tensors=tensors, contents=contents,
                  meta=meta, keep=keep, group=group, device=device)


NOT_LEADER = -3
"""What the ranks but the leader put into the MAX that spreads `claim`'s token (below every
token the leader may post)."""


def claim(root: Path, step: int) -> tuple[int, CheckpointError | None]:
    """The leader's local part of `start`: create the temporary folder of ``step``; the token
    to spread to every rank by a MAX (with `NOT_LEADER` from the others; a caller may reduce
    it with its own values in one collective) and, when it failed, the error."""
    final = root / f"step-{step}"
    try:
        with save_errors(final, final, clean=False):
            root.mkdir(parents=True, exist_ok=True)
            if committed(final):
                return _COMMITTED, None
            token = secrets.randbits(31)
            _tmp(root, step, token).mkdir()
            return token, None
    except CheckpointError as exc:
        return _FAILED, exc


def release(root: Path, step: int, token: int) -> None:
    """On the leader: remove the (empty) folder `claim` created, when the ranks decided
    not to save after all (a non-finite weight on some rank)."""
    if token >= 0:
        _tmp(root, step, token).rmdir()


def opened(root: Path, step: int, token: int, error: CheckpointError | None, *,
           tensors: dict[str, torch.Tensor], contents: Any, meta: dict[str, Any], keep: int,
           group: Communicator, device: torch.device) -> Save | None:
    """The save `claim`'s ``token`` (as every rank received it) names; ``error``: the leader's
    (None elsewhere). Raises on every rank when the leader could not create the folder."""
    final, leader = root / f"step-{step}", group.rank == 0
    if token == _FAILED:  # every rank raises here, the leader's message is printed
        raise (error or CheckpointError(
            "checkpoint save failed", str(final), "the leading rank could not create the "
            "folder (its message says why)", "Check free space and permissions of --run-dir"
        )).everywhere(report=leader)
    if token == _COMMITTED:
        return None
    return Save(root, step, _tmp(root, step, token), final, keep, group, device, tensors,
                contents, meta, rng_state() if leader else ({}, []))


def _tmp(root: Path, step: int, token: int) -> Path:
    return root / f"step-{step}.tmp-{token:08x}"


@dataclass
class Save:
    """One checkpoint between `start` and `finish`: what each phase needs and measured."""

    root: Path
    step: int
    tmp: Path
    final: Path
    keep: int
    group: Communicator
    device: torch.device
    tensors: dict[str, torch.Tensor]
    contents: Any
    meta: dict[str, Any]
    rng: RandomState
    """The leader's random state at `start` (empty on the others)."""

    def __post_init__(self) -> None:
        self.staged.set()  # staged by the caller, unless it leaves staging to `copy` (`later`)
        self.gathering = Gathering(self.tmp, self.group.size)

    def later(self, prepare: Callable[[], tuple[dict[str, tuple[torch.Tensor, torch.Tensor]],
                                                 list[Any]]]) -> None:
        """The staging is still to be done, by `copy`: ``prepare`` says, for every key of the
        tensor file, the host tensor and what to copy into it, and the index entries
        (`trainer.checkpoint.pieces.staging`); `write` waits for that."""
        self.prepare = prepare
        self.staged.clear()
    started: float = field(default_factory=time.perf_counter)
    started_at: float = field(default_factory=time.time)
    """The wall clock at `started`: each rank's record carries it, so the save's seconds
    start at the first rank's (ranks reach a save at different times and write at once; on
    several hosts, as far as their clocks agree)."""
    prepare: Callable[[], tuple[dict[str, tuple[torch.Tensor, torch.Tensor]],
                                list[Any]]] | None = None
    """The staging `copy` does, when the caller left it for later (`later`): the training
    must not change a source (nor the optimizer's state, which it reads) before `staged` is
    set."""
    staged: threading.Event = field(default_factory=threading.Event)
    images: Images | None = None
    """Where the caller keeps its tensor file's layout from save to save (`files.Images`)."""
    copy_error: Exception | None = None
    written: Records = field(default_factory=dict)
    write_s: float = 0.0
    write_at: float = 0.0
    """The wall clock when this rank's `write` began (`busy`)."""
    rng_record: FileRecord | None = None
    """The leader's ``rng.safetensors``, written by `write`."""
    gathered: list[Any] = field(default_factory=list)
    """Every rank's record (`_record`), read by the leader at the commit."""
    gathering: Gathering = field(init=False)
    """The leader's reading of every rank's record (`settle`, `commit`)."""
    _posted: Posted | None = None
    """The agreement on the writes, when the leader went on before reading it (`settle`)."""
    commit_s: float = 0.0
    """Seconds from the first rank's `start` to the end of the commit (the leader's; pruning
    after it)."""
    busy_s: float = 0.0
    """Seconds the save was writing (`busy`): what its MB/s is measured over."""
    leader_syncs: bool = False
    """This rank's tensor file is fsynced by the leader's commit, with its own files at once
    (`trainer.checkpoint.commit`), not at the end of its write: only where the leader's
    kernel holds what this rank wrote (its host; the file's last page waits in the page
    cache); elsewhere (a shared filesystem) the leader's fsync would not reach it."""
    prune_later: bool = False
    """Pruning is left to the caller (`prune`, after the commit: `trainer.checkpoint.writer`
    runs it in its thread once the save is finished) instead of ending the commit."""
    prunable: bool = False
    """The leader committed this save: `prune` has something to do."""
    prune_s: float | None = None
    """Seconds the leader's pruning took after the commit (None: not done yet when the save
    was reported, `prune_later`)."""
    checks: tuple[int, ...] = ()
    """The caller's own values, MAXed over every rank in `settle`'s collective (`agreed`):
    a save in place agrees on its weights' check with its writes rather than in a collective
    of its own (`trainer.training.checkpointing`). Only a settle that agrees collectively
    carries them: a save with checks is never settled by a late vote alone."""
    agreed: list[int] = field(default_factory=list)
    accept: Callable[[Save], None] | None = None
    """Called on every rank once `settle` agreed on `checks` (before the commit): what it
    raises, every rank raises alike."""

    @property
    def leader(self) -> bool:
        return self.group.rank == 0

    @property
    def syncs(self) -> bool:
        """This rank fsyncs its own tensor file (`leader_syncs`)."""
        return not (self.leader or self.leader_syncs)

    def attempt(self, phase: Callable[[], Any]) -> CheckpointError | None:
        """Run a local phase (`write`, `commit`; any thread); its error as users see it."""
        try:
            with save_errors(self.tmp, self.final, clean=False):
                phase()
        except CheckpointError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable state: the others wait
            return CheckpointError("checkpoint save failed", str(self.tmp),
                                   f"{type(exc).__name__}: {exc}",
                                   "Save only tensors and plain Python values")
        return None

    def copy(self) -> None:
        """The staging the caller left for later (`later`; any thread, before `write`, which
        waits for it): ``tensors`` and ``contents`` are set here, off the training thread,
        and the state copied in one call (no Python per tensor, holding the interpreter's
        lock). `staged` is set after it, even when it failed: `write` raises its error, which
        stops every rank at `settle`."""
        try:
            if self.prepare is not None:
                pairs, self.contents = self.prepare()
                self.tensors = {key: host for key, (host, _) in pairs.items()}
                if pairs:
                    torch._foreach_copy_([h for h, _ in pairs.values()],
                                         [s for _, s in pairs.values()])
        except Exception as exc:  # noqa: BLE001 - raised by write, on the writer's thread
            self.copy_error = exc
        finally:
            self.prepare = None
            self.staged.set()

    def write(self) -> None:
        """This rank's tensor file, hashed as written, fsynced here unless the leader's
        commit fsyncs it (`leader_syncs`); then the staged copy is let go."""
        self.staged.wait()
        if self.copy_error is not None:
            raise self.copy_error
        self.tmp.mkdir(parents=True, exist_ok=True)
        fault("save_after_stage", self.step)
        if self.leader and self.checks and self.group.size > 1:  # a settle in a collective:
            self.gathering.start()  # the commit begins once every record is read
        began, self.write_at = time.perf_counter(), time.time()
        if self.tensors:
            name = rank_file(self.group.rank)
            self.written[name] = write_tensors(self.tmp / name, self.tensors,
                                               lambda: fault("save_after_write", self.step),
                                               self.images, sync=self.syncs)
        self.tensors = {}
        if self.leader:  # known since `start`: written now, alongside the other ranks' files,
            # rather than in the commit, which every rank waits for; fsynced by the commit
            # with every other file (`commit_folder`)
            self.rng_record = write_tensors(self.tmp / RNG, self.rng[0], sync=False)
        self.write_s = time.perf_counter() - began
        if self.leader:
            self.gathering.own(self._record())
        else:
            leave(self.tmp, self.group.rank, self._record())  # last: what the leader reads
        fault("save_after_tensors", self.step)

    def _record(self) -> dict[str, Any]:
        """What the leader needs of this rank's write: its files' records and contents."""
        return {"files": {n: r.to_json() for n, r in self.written.items()},
                "synced": self.syncs, "checks": list(self.checks),
                "contents": self.contents if self.written else None, "write_s": self.write_s,
                "started_at": self.started_at, "write_at": self.write_at}

    def settle(self, error: CheckpointError | None, failed: bool | None = None) -> None:
        """Collective: every rank's `write` succeeded (else every rank raises), with
        `checks` agreed (`accept` called). ``failed``: what a late vote said of every rank's
        write (False: all succeeded, nothing to agree unless there are `checks`; None: no
        vote). The leader goes on to its commit as soon as every rank's record is in the
        folder (`trainer.checkpoint.records`), its agreement read by `finish`."""
        if failed is False and not self.checks:
            return
        posted = post(self.group, error, self.device, "write its tensor file", self.checks)
        if self.leader and error is None and not failed and self.gathering.until(posted.handle):
            self._posted = posted
            checks = [r["checks"] for r in self.gathering.rest()]
            self.agreed = [max(values) for values in zip(*checks, strict=True)]
        else:
            self.gathering.stop()
            self.agreed = conclude(self.group, posted, self.tmp, self.final)
        if self.accept is not None:
            try:
                self.accept(self)
            except BaseException:
                self._concluded()  # the others wait for the leader's part
                raise

    def _concluded(self) -> None:
        """The agreement on the writes the leader did not wait for (`settle`), read."""
        posted, self._posted = self._posted, None
        if posted is not None:
            conclude(self.group, posted, self.tmp, self.final)

    def commit(self) -> None:
        """On the leader: index, RNG, meta, rename, commit record; then `prune`, unless
        `prune_later`."""
        if self.leader:  # every rank left its record, read and removed here
            self.gathered = self.gathering.rest()
        wrote = self.leader and not committed(self.final)
        if self.leader and not wrote:  # a save named by an earlier token: the committed
            discard(self.tmp, self.final)  # checkpoint stays, as `claim` keeps it
        elif self.leader:
            records = {n: FileRecord(r["size"], r[checksum.WRITTEN]) for g in self.gathered
                       for n, r in g["files"].items()}
            index = {"files": {n: g["contents"] for g in self.gathered for n in g["files"]}}
            if self.rng_record is not None:
                records[RNG] = self.rng_record
            commit_folder(self.root, self.tmp, self.final, self.step, self.meta, self.rng,
                          index, records, started=self.gathering.syncing)
        first = min((g.get("started_at", self.started_at) for g in self.gathered),
                    default=self.started_at)
        self.commit_s = max(time.perf_counter() - self.started, time.time() - first)
        self.busy_s = busy([(g["write_at"], g["write_at"] + g["write_s"])
                            for g in self.gathered if "write_at" in g], time.time())
        self.prunable = wrote
        if not self.prune_later:
            self.prune()

    def prune(self) -> None:
        """On the leader, after the commit (which it follows in any thread, never
        before): delete the checkpoints beyond ``keep`` and the leftovers of dead saves
        (`trainer.checkpoint.prune`). After the save's clock: deleting writes nothing."""
        if self.prunable:
            self.prunable, pruning = False, time.perf_counter()
            prune(self.root, keep=self.keep, current=self.step)
            self.prune_s = time.perf_counter() - pruning

    def finish(self, error: CheckpointError | None, failed: bool | None = None) -> Path:
        """Collective: the commit succeeded (else every rank raises); the folder. ``failed``:
        what a late vote said of it (False: nothing to agree; None: no vote)."""
        self._concluded()
        if failed is not False:
            agree(self.group, error, self.tmp, self.final, self.device, "commit")
        return self.final

    def report(self) -> dict[str, Any]:
        """What the save wrote and how fast (meaningful on the leader: `rate.report`)."""
        return report(self.step, self.gathered, self.commit_s, self.busy_s, self.prune_s)


class _Alone:
    """The group of a process that saves alone."""

    rank, size = 0, 1

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        pass

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False) -> None:
        pass
