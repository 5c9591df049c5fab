"""Deleting checkpoints so that a kill at any moment leaves only resumable states.

A folder loses its marker first (fsynced), then its files one by one, then itself: a kill
half-way leaves an uncommitted ``step-<N>/`` that no resume reads and the next prune deletes.

Nothing is deleted through a symbolic link: a ``step-<N>`` that is a link (an archived
checkpoint linked back, or one planted there) or a file is never listed (`layout.strays`);
pruning reports it once per process and leaves it, and `remove` refuses anything but a real
folder, deleting the links inside one as links. Nothing but what a save writes is deleted: an
uncommitted ``step-<N>`` holding anything else (a user's own folder) is no dead save and is
reported like a link, and `remove` deletes only a checkpoint's own files (`layout.OWN_FILE`),
leaving a folder that holds more in place (reported from then on).
"""

from __future__ import annotations

import sys
from pathlib import Path

from trainer.checkpoint.fault import fault
from trainer.checkpoint.files import fsync_path
from trainer.checkpoint.layout import (
    MARKER,
    OWN_FILE,
    CheckpointError,
    leftover_step,
    real_folder,
    step_dirs,
    stray_kind,
    strays,
)

_reported: set[Path] = set()  # strays already warned about by this process


def prune(root: Path, *, keep: int, current: int) -> None:
    """Delete committed checkpoints beyond the newest ``keep`` (0 = keep all) and the leftovers
    of dead saves (temporaries, folders without a marker) of steps up to ``current``.

    Leftovers of later steps stay: they belong to a save that a resumed run redoes (it replaces
    them) and may not be deleted by a run that resumed further back."""
    committed = step_dirs(root)
    doomed = [committed[step] for step in sorted(committed)[:-keep]] if keep > 0 else []
    for child in sorted(root.iterdir()):
        step = leftover_step(child)
        if step is not None and step <= current:
            doomed.append(child)
    for path in doomed:
        remove(path, current)
        fault("prune_after_remove", current)
    warn_strays(root)


def warn_strays(root: Path) -> None:
    """Say once per process which entries named like checkpoints are not ours (`strays`)."""
    for path in strays(root):
        if path in _reported:
            continue
        _reported.add(path)
        print(f"warning: not a checkpoint folder [{path}]: it is {stray_kind(path)}; dtrain "
              "never lists, loads, prunes or deletes through it and leaves it as it is. Move "
              "it out of "
              f"{root} (copy a checkpoint in, not a link, to resume from it)", file=sys.stderr,
              flush=True)


def remove(path: Path, current: int) -> None:
    """Delete one checkpoint folder, marker first (``current``: the step being saved). Only a
    real folder: a link is refused, never followed; links inside are deleted as links. Only
    what a save writes is deleted: a folder holding more stays, with the rest."""
    if path.is_symlink() or not path.is_dir():
        raise CheckpointError("refusing to delete a checkpoint", str(path),
                              "it is a symbolic link or not a folder, and deleting through it "
                              "would delete files outside the run dir",
                              f"Move it out of {path.parent}")
    marker = path / MARKER
    if marker.exists() or marker.is_symlink():
        marker.unlink()
        fsync_path(path)
        fault("remove_after_marker", current)
    kept = False
    for i, child in enumerate(sorted(path.iterdir())):
        if OWN_FILE.match(child.name) and not real_folder(child):
            child.unlink()
        else:
            kept = True
        if i == 0:
            fault("remove_mid_files", current)
    if not kept:
        path.rmdir()
