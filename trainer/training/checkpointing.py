"""The training loop's checkpoints: what every rank stages at a save step, and who writes it.

At a save step every rank checks that no weight is NaN or infinite (agreed by every rank
before the commit, below), stages a copy on the CPU of the slices it is the writer of (one
writer per slice, spread over the ranks that hold it: `trainer.checkpoint.pieces`), into host
tensors allocated once at start-up and reused, with the step's metadata and random state
(`trainer.checkpoint.save.opened`). With ``--async-save`` (the default) the loop goes on at once:
a CPU state is copied by a helper thread while the next step's forward and backward run (they
read the weights, never change them; AdamW's step, which does, waits for the copy), and
`trainer.checkpoint.writer` writes, fsyncs and commits in the background; the training never
touches the staged copy, so the checkpoint holds the state of the step it names. Without it the
loop waits for the commit.

The weights' check and AdamW's step count are agreed by all ranks, never in a collective of
their own before the writes: a collective there waits for the slowest rank to reach the save
(ranks reach it apart: the pipeline's stages end their steps at different times) while none
writes. The folder's name is agreed once, at start-up (`run_token`: one random 62-bit token
per run, so a resumed or restarted run never writes into a dead save's folder), and each writer
creates the folder it writes into. In place (and for the last save, which is waited for
anyway) the check and the count ride in the one collective after the writes, which agrees that
every write succeeded (`Save.checks`): a weight not finite on any rank drops the save there,
before its commit, the leader removes the folder, and every rank raises the divergence (profiled
at dp 2 x tp 2 x pp 2, 8 ranks on 2 cores, a 39 MB save: the collective before the writes and
the gather after them were 15-40 ms of 68-98; the save now takes 31-39 ms, the disk's time for
its bytes and a few ms). In the background the collective after the writes comes a step or more
later, so there the agreement is late, like the writer's vote: posted non-blocking at the save's
step and read at the next step's end (`Checkpoints.poll`), before anything can move the save on
(the writer settles a save only after a later vote, read a step later still). When the
late agreement finds a weight not finite on any rank, every rank drops the save: each lets its
thread finish, the ranks meet (so nobody writes any more), the leader removes the folder, the
ranks meet again (so nobody writes into a folder of that name before it is gone), and every
rank raises the divergence, one step after the save's. The file is never committed:
the commit comes after the settle, which comes after that read.

What each save measured (MB and MB/s in all and per rank, seconds until committed, seconds the
loop was blocked, of which waiting for the save before it, and the seconds the ends of later
steps spent moving it on: the votes, and the collectives that settle and finish it) goes into
the ``checkpoint`` field of the first ``metrics.jsonl`` record logged after the save was seen
committed.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.failure import discard
from trainer.checkpoint.files import Images
from trainer.checkpoint.pieces import MOMENTS, Held, adam_step, held, stage, staging
from trainer.checkpoint.run_dir import folder
from trainer.checkpoint.save import NOT_LEADER, Save, claim, opened, release
from trainer.checkpoint.writer import Writer
from trainer.comm.bootstrap import World
from trainer.comm.protocol import Agreement, ReduceOp, wait_quietly
from trainer.data.token_batches import TokenBatches
from trainer.placement import writers
from trainer.training.guard import diverged, nonfinite
from trainer.training.resume import meta_of, run_meta
from trainer.training.run import Run


@dataclass(frozen=True)
class Late:
    """How a background save agrees without waiting (module docstring): the non-blocking MAX
    its check and step count go into, and the run's folder token."""

    agreement: Agreement
    token: int


def run_token(run: Run) -> int:
    """Collective, once at start-up: the leader's random folder token of this run, on every
    rank (62 bits: a folder name no earlier run's leftover holds)."""
    group = run.mesh.group()
    token = torch.tensor([secrets.randbits(62) if group.rank == 0 else 0], dtype=torch.int64,
                         device=run.mesh.device)
    group.all_reduce(token, ReduceOp.MAX)
    return int(token)


def begin(run: Run, step: int, pool: dict[str, torch.Tensor] | None = None, *,
          defer: bool = False, late: Late | None = None, token: int | None = None,
          owners: list[bool] | None = None, run_part: dict[str, Any] | None = None,
          root: Path | None = None) -> Save | None:
    """Collective: check the weights, stage this rank's slices (into ``pool``'s host tensors,
    `trainer.checkpoint.pieces.stage`), create the save's folder (None: ``step`` is already
    committed).

    One all-reduce (MAX) carries all the ranks agree on: whether a weight is not finite on any
    rank, AdamW's step count (a rank may hold no state of its own) and the leader's folder
    token (`trainer.checkpoint.save.claim`). A collective costs a scheduling round over every
    rank, the larger part of the time a background save blocks the loop (profiled at dp 2 x
    tp 2 x pp 2: three collectives, 56 of the 70 samples in the save); the leader removes the
    folder again when a weight is not finite. ``defer``: a CPU state is neither staged nor
    copied here but in a helper thread (`Save.later`: which slices and where to, read from
    the optimizer's state, then the copy: 0.16 ms of the training thread's CPU per save
    at dp 2 x tp 2 x pp 2 on 2 cores), while the next step's forward and backward run; the
    caller waits for `Save.staged` before anything changes the weights or the optimizer's
    state (`Checkpoints`).
    ``late``: the check and the step count are posted to ``late.agreement`` instead, for the
    caller to read later (`Checkpoints`; the meta's step count is this rank's until then), and
    the folder is named by ``late.token``: no collective, never None. ``token`` (a save
    waited for): the folder is named by it, and the check and the step count are agreed in
    the one collective after the writes (`Save.checks`, `Save.settle`): no collective here,
    never None; a weight not finite on any rank drops the written save before its commit
    (the leader removes the folder) and raises the divergence on every rank. ``owners``:
    `trainer.placement.writers` of this rank's slices, when the caller kept it (it never
    changes during a run); ``run_part``: `trainer.training.resume.run_meta`, kept likewise;
    ``root``: the checkpoint folder (`trainer.checkpoint.run_dir.folder`), kept likewise: a
    system call on the training thread lets the writer's threads take the interpreter's
    lock, and the training thread then waits for them to let it go."""
    began, began_at = time.perf_counter(), time.time()  # the save's clock (`Save.report`)
    # covers staging too
    weights, mesh = run.weights, run.mesh
    group, root = mesh.group(), root or folder(Path(run.cfg.run_dir))
    bad = nonfinite(weights.values())

    def mine() -> list[Held]:
        return held(weights.values(), weights.optimizer)

    writes = owners if owners is not None else writers([h.placement for h in mine()], mesh)
    later = defer and not any(t.is_cuda for t in weights.values())
    staged, contents = ({}, []) if later else stage(mine(), writes, pool)
    count = adam_step(weights.optimizer)
    error = None
    if late is not None:
        late.agreement.post(int(bad), count)
        token = late.token
    elif token is None:
        token, error = claim(root, step) if group.rank == 0 else (NOT_LEADER, None)
        agreed = torch.tensor([bad, count, token], dtype=torch.int64, device=mesh.device)
        wait_quietly(group.all_reduce(agreed, ReduceOp.MAX, async_op=True))
        bad, count, token = (int(v) for v in agreed.tolist())
        if bad:
            if group.rank == 0:
                release(root, step, token)
            raise diverged(step, report=run.is_writer)
    meta = _meta(run, step, count, run_part) if group.rank == 0 else {}  # only the leader
    # writes it
    job = opened(root, step, token, error, tensors=staged, contents=contents, meta=meta,
                 keep=run.cfg.checkpoint.keep, group=group, device=mesh.device)
    if job is not None:
        job.started, job.started_at = began, began_at
        if later:  # what is staged, and the copy, worked out in the copier's thread
            job.later(lambda: staging(mine(), writes, pool))
        if late is None and token is not None:
            job.checks, job.accept = (int(bad), count), _accepted(run)
    return job


def _meta(run: Run, step: int, count: int, run_part: dict[str, Any] | None) -> dict[str, Any]:
    """What the leader's ``meta.json`` of save ``step`` holds besides the format and the
    random state (``count``: AdamW's step count, this rank's until agreed)."""
    groups = [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay")}
              for g in run.weights.optimizer.param_groups]
    samples = run.batches.position.to_dict() if isinstance(run.batches, TokenBatches) else None
    return meta_of(run.cfg, step, source=run.corpus.source, fingerprint=run.corpus.fingerprint,
                   optimizer={"step": count, "groups": groups}, samples=samples,
                   run_part=run_part)


def _accepted(run: Run) -> Callable[[Save], None]:
    """What a save waited for does once every rank agreed on its checks (`begin`'s
    ``token``): a weight not finite on any rank drops it (the folder removed by the leader:
    every rank has written and nobody writes into it any more) and raises the divergence on
    every rank; else AdamW's agreed step count goes into its meta."""
    def accept(job: Save) -> None:
        bad, count = job.agreed
        if bad:
            if job.leader:
                discard(job.tmp, job.final)
            raise diverged(job.step, report=run.is_writer)
        if job.leader:
            job.meta["optimizer"]["step"] = count

    return accept


def save_checkpoint(run: Run, step: int) -> Path:
    """Every rank saves checkpoint ``step`` together and waits for its commit; its folder."""
    job = begin(run, step)
    if job is None:
        return folder(Path(run.cfg.run_dir)) / f"step-{step}"
    writer = Writer(None, background=False)
    writer.submit(job)
    writer.wait()
    return job.final


class Checkpoints:
    """The saves of one run, at most one in flight (collective calls, on every rank alike)."""

    def __init__(self, run: Run, world: World) -> None:
        self.run, self.background = run, run.cfg.checkpoint.async_save
        vote, self._late = None, None
        # The folder token of the saves waited for (in place, the last one), which agree on
        # their checks with their writes (`begin`); one rank alone agrees with nobody.
        self._token = token = run_token(run) if world.size > 1 else None
        if self.background and token is not None:
            from trainer.comm.mpi.vote import LateMax  # mpi4py: the adapter

            vote = LateMax(world.mpi_comm)
            self._late = Late(LateMax(world.mpi_comm, width=2), token)
        self._vote = vote
        self._unread: Save | None = None  # begun late, its agreement not read yet
        self.writer = Writer(vote, background=self.background)
        self.blocked: dict[int, float] = {}  # seconds the loop waited, per step saved
        self.waited: dict[int, float] = {}  # of which for the save before it
        self.step_ends: dict[int, float] = {}  # seconds step ends spent moving it on
        self.reports: list[dict[str, Any]] = []  # finished saves not logged yet
        self.pool: dict[str, torch.Tensor] = {}  # the host copies, reused save after save
        self.images = Images()  # and the layout of their file
        self.owners: list[bool] = []  # which slices this rank writes (`_allocate`)
        self._run_part = run_meta(run.cfg) if run.mesh.group().rank == 0 else None
        self.root = folder(Path(run.cfg.run_dir))  # resolved once (`begin`'s ``root``)
        # On rank 0's host (the leader's kernel holds what this rank writes), the leader's
        # commit fsyncs this rank's file (`Save.leader_syncs`): ranks are numbered host by
        # host (`workerenv`; plain mpiexec: among a host's ranks in rank order), so a rank is
        # its own local rank only there.
        self._beside_leader = world.rank == world.local_rank
        self._allocate()
        # The writer copies the state while the next step computes; AdamW's step is the one
        # thing that changes it, so it first waits for that copy.
        run.weights.optimizer.register_step_pre_hook(lambda *_: self._staged())
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-stage")
        self._copier.submit(lambda: None).result()  # its thread started now, not at a save

    def _staged(self) -> None:
        """Before the optimizer steps: the save in flight holds its copy of the state (the
        wait counts as time the loop was blocked by that save)."""
        save = self.writer.save
        if save is not None and not save.staged.is_set():
            began = time.perf_counter()
            save.staged.wait()
            self.blocked[save.step] = self.blocked.get(save.step, 0.0) + \
                time.perf_counter() - began

    def _allocate(self) -> None:
        """Allocate and touch the host copies now (each moment shaped as its parameter: the
        optimizer has none before its first step), so no save pays for page faults."""
        mine = held(self.run.weights.values(), self.run.weights.optimizer)
        shaped = [Held(h.tensor, h.placement, dict.fromkeys(MOMENTS, h.tensor)) for h in mine]
        self.owners = writers([h.placement for h in mine], self.run.mesh)
        stage(shaped, self.owners, self.pool)

    def describe(self) -> str:
        """The start-up line: how saves are written, and the host memory kept for staging."""
        mib = sum(t.numel() * t.element_size() for t in self.pool.values()) / 2**20
        how = "in the background (--async-save), one save in flight at a time" \
            if self.background else "in place (--no-async-save)"
        return f"checkpoints: written {how}; rank 0 keeps {mib:.1f} MiB of host memory for " \
               "the staged copy"

    def save(self, step: int) -> Path:
        """Checkpoint ``step``: waits for the save in flight, stages, and hands it to the
        writer (with --no-async-save: returns once it is committed)."""
        return self._save(step, wait=not self.background)

    def last(self, step: int) -> Path:
        """The last checkpoint (end of training, --time-limit, SIGTERM): saved and waited for."""
        return self._save(step, wait=True)

    def _save(self, step: int, *, wait: bool) -> Path:
        began = time.perf_counter()
        self._agreed()
        previous, done = self.writer.wait(), None
        self.waited[step] = time.perf_counter() - began
        # The previous save is written: reuse its copies.
        late = None if wait else self._late
        # In place the loop waits anyway: copied here, not handed to a thread and waited for.
        job = begin(self.run, step, self.pool, defer=not wait, late=late,
                    token=self._token if wait else None, owners=self.owners,
                    run_part=self._run_part, root=self.root)
        if late is not None:
            self._unread = job
        if job is not None:
            job.images, job.prune_later = self.images, not wait
            job.leader_syncs = self._beside_leader
            if not job.staged.is_set():
                self._copier.submit(job.copy)
            self.writer.submit(job)
            done = self.writer.wait() if wait else None
        self.blocked[step] = time.perf_counter() - began
        self._finished(previous)
        self._finished(done)
        return self.root / f"step-{step}"

    def poll(self) -> None:
        """At the end of every step: let the save in flight move on (its error raises here;
        the seconds it takes count as the save's ``step_end_s``)."""
        self._agreed()
        save = self.writer.save
        if save is None:
            return
        began = time.perf_counter()
        try:
            finished = self.writer.poll()
        finally:
            self.step_ends[save.step] = self.step_ends.get(save.step, 0.0) + \
                time.perf_counter() - began
        self._finished(finished)

    def _agreed(self, *, stopping: bool = False) -> None:
        """Read the late agreement of the save begun last, once (collective; the wait counts
        as time that save blocked the loop): AdamW's agreed step count goes into its meta; a
        weight not finite on any rank drops the save on every rank and raises the divergence
        (module docstring), or only drops it when ``stopping`` (another error ends the run)."""
        job, self._unread = self._unread, None
        if job is None or self._late is None:
            return
        began = time.perf_counter()
        bad, count = self._late.agreement.results()
        self.blocked[job.step] = self.blocked.get(job.step, 0.0) + time.perf_counter() - began
        if not bad:
            if job.leader:
                job.meta["optimizer"]["step"] = count
            return
        self.writer.abandon()  # this rank's thread writes no more
        meet = torch.zeros(1, dtype=torch.int64, device=job.device)
        job.group.all_reduce(meet)  # nor any rank's
        if job.leader:
            discard(job.tmp, job.final)
        job.group.all_reduce(meet)  # gone before any rank goes on (a later save of this step
        # writes into a folder of the same name)
        self.blocked.pop(job.step, None)
        if not stopping:
            raise diverged(job.step, report=self.run.is_writer)

    def take_reports(self) -> list[dict[str, Any]]:
        """What the saves finished since the last call measured (rank 0's view: every rank's
        sizes and rates)."""
        out, self.reports = self.reports, []
        return out

    def close(self, *, clean: bool) -> None:
        """``clean``: training ended alike on every rank, or with an error every rank raised
        together (a NaN stop): the save in flight is finished (collective, as is freeing the
        vote's communicator); else only this rank's thread finishes its file."""
        self._copier.shutdown(wait=True)  # a copy is short and never blocks
        if not clean:
            self.writer.abandon()
            self.writer.close()
            return
        self._agreed(stopping=True)
        self.writer.wait()
        self.writer.close()
        if self._vote is not None:
            self._vote.close()
        if self._late is not None:
            self._late.agreement.close()

    def _finished(self, save: Save | None) -> None:
        if save is not None and self.run.is_writer:
            self.reports.append({**save.report(),
                                 "blocked_s": round(self.blocked.pop(save.step, 0.0), 4),
                                 "waited_s": round(self.waited.pop(save.step, 0.0), 4),
                                 "step_end_s": round(self.step_ends.pop(save.step, 0.0), 4)})

