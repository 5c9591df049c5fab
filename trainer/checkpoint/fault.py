"""The test hook ``DTRAIN_FAULT=<point>[@<step>]``: SIGKILL this process, like a power cut, when
it reaches ``point`` while saving checkpoint ``step`` (any step without ``@``).

Points, in the order a save reaches them (`trainer.checkpoint.save`, `trainer.checkpoint.prune`;
with ``--async-save`` the writer's background thread reaches every one, and kills the process
from there while the training thread runs a later step):

    save_after_stage     the state is staged (copied off the training's tensors) and the
                         temporary folder exists; nothing is written (every rank)
    save_after_write     this writer's tensor file is written, not yet fsynced
    save_after_tensors   this writer's tensor file is in the temporary folder, fsynced (or
                         left for the leader's commit to fsync) and its record beside it
    save_after_rng       the leader wrote index.json and rng.safetensors
    save_after_meta      meta.json written and the folder fsynced, before the rename
    save_after_rename    renamed to step-<N>/, before the marker
    save_after_marker    committed, before pruning
    remove_after_marker  deleting a folder: its marker is gone, its files are not
    remove_mid_files     deleting a folder: one file deleted, the others not
    prune_after_remove   one old folder deleted, before the next
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "DTRAIN_FAULT"
POINTS = ("save_after_stage", "save_after_write", "save_after_tensors", "save_after_rng",
          "save_after_meta", "save_after_rename", "save_after_marker", "remove_after_marker",
          "remove_mid_files", "prune_after_remove")


def fault(point: str, step: int) -> None:
    """Die at ``point`` when ``DTRAIN_FAULT`` names it (and ``step``, if it names one)."""
    spec = os.environ.get(FAULT_ENV, "")
    name, _, at = spec.partition("@")
    if name == point and (not at or int(at) == step):
        os.kill(os.getpid(), signal.SIGKILL)
