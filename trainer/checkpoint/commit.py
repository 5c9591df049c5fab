"""The leader's commit of a checkpoint: index, meta and the commit record into the temporary
folder, every file made durable, the folder renamed into place, then the record, with two
waits for the disk.

Every tensor file is written by its writer before the commit begins (the leader read every
writer's record, `trainer.checkpoint.records`); those of the leader's host are fsynced by the
leader, each as its record arrived, and waited for with its own files
(`trainer.checkpoint.save.Save.leader_syncs`). What the commit adds, and in
which order it becomes durable, is what keeps a crash at any point from leaving a checkpoint
that is named as committed but lacks a file (`commit_folder`). Each fsync is a journal commit
(1-5 ms on the development VM when idle, 1-50 ms with other programs writing); the files and
folders that may become durable in any order among themselves are fsynced at once
(`trainer.checkpoint.files.fsync_all`), and the journal commits concurrent fsyncs together:
two rounds instead of six, one file or folder at a time (profiled at dp 2 x tp 2 x pp 2 on
2 cores: 8-14 ms of a 39 MB save before, about 4 after), and instead of three where each rank
fsynced its own file at the end of its write (the ranks finish apart, so their fsyncs were
rounds of their own before the commit could begin, 2026-11-29).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.fault import fault
from trainer.checkpoint.files import FileRecord, fsync_all, write_bytes, write_tensors
from trainer.checkpoint.layout import (
    FORMAT_VERSION,
    INDEX,
    MARKER,
    META,
    RNG,
    CheckpointError,
    foreign,
)
from trainer.checkpoint.prune import remove

Records = dict[str, FileRecord]
RandomState = tuple[dict[str, torch.Tensor], list[Any]]


def rng_state() -> RandomState:
    """This process's random states: torch's (CPU, and CUDA's) as tensors, Python's as JSON."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors |= {f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    version, internal, gauss = random.getstate()
    return tensors, [version, list(internal), gauss]


def commit_folder(root: Path, tmp: Path, final: Path, step: int, meta: dict[str, Any],
                  random_state: RandomState, index: dict[str, Any], written: Records,
                  started: Sequence[Future[None]] = ()) -> None:
    """Index, meta and the commit record into ``tmp``, rename it to ``final``, then the
    commit record to its name: two waits for the disk (`fsync_all`), not one per file.
    ``started``: the fsyncs of the files of ``written`` their writers left to the leader,
    started as each was written (`fsync_soon`), waited for with the first wait.

    What a crash (of the machine: what is durable) leaves at each point; a resume reads only
    ``step-<N>`` folders holding ``COMMITTED``, and prunes older checkpoints only after the
    second wait, so the previous checkpoint is whole until this one is:

    1. index, meta, the RNG file and the record (still ``.COMMITTED.tmp``) written, then
       fsynced with the tensor files left unsynced and the temporary folder (every file's
       name; the other writers fsynced their own files): before this returns, a temporary
       folder, never read, pruned by a later save;
    2. the folder renamed to ``step-<N>``: a folder without ``COMMITTED`` (or, where the
       rename is not durable yet, the temporary one): never read, pruned later;
    3. the record renamed to ``COMMITTED``, then both folders fsynced: either no ``step-<N>``
       or one without ``COMMITTED`` (as 2), or, since every file it names was durable
       before either rename, a whole checkpoint. The record is renamed into place, not
       written there: it is whole or absent, never torn by a full disk or a crash.
    """
    files = dict(written)
    files[INDEX] = write_bytes(tmp / INDEX, json.dumps(index).encode(), sync=False)
    rng, python = random_state
    if RNG not in files:  # the leader's `Save.write` wrote it already (not fsynced: below)
        files[RNG] = write_tensors(tmp / RNG, rng, sync=False)
    fault("save_after_rng", step)
    body = {"format": FORMAT_VERSION, "step": step, **meta, "python_rng": python}
    files[META] = write_bytes(tmp / META, json.dumps(body, indent=2, sort_keys=True).encode(),
                              sync=False)
    record = {"format": FORMAT_VERSION, "step": step,
              "files": {name: rec.to_json() for name, rec in sorted(files.items())}}
    aside = f".{MARKER}.tmp"
    write_bytes(tmp / aside, json.dumps(record, indent=1).encode(), sync=False)
    fsync_all([tmp / INDEX, tmp / META, tmp / RNG, tmp / aside, tmp], started)
    fault("save_after_meta", step)
    if foreign(final):
        raise CheckpointError("refusing to replace a folder that is not a checkpoint",
                              str(final), f"it holds {', '.join(foreign(final))}, which no "
                              "save writes", f"Move it out of {root}")
    if final.exists() or final.is_symlink():
        remove(final, step)  # an uncommitted leftover of a save that died after its rename
        # (a link there is refused, not followed)
    tmp.rename(final)
    fault("save_after_rename", step)
    (final / aside).rename(final / MARKER)
    fsync_all([final, root])
    fault("save_after_marker", step)
