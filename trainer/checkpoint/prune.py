"""Deleting checkpoints so that a kill at any moment leaves only resumable states.

A folder loses its marker first (fsynced), then its files one by one, then itself: a kill
half-way leaves an uncommitted ``step-<N>/`` that no resume reads and the next prune deletes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from trainer.checkpoint.fault import fault
from trainer.checkpoint.files import fsync_dir
from trainer.checkpoint.layout import MARKER, leftover_step, step_dirs


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


def remove(path: Path, current: int) -> None:
    """Delete one checkpoint folder, marker first (``current``: the step being saved)."""
    marker = path / MARKER
    if marker.exists():
        marker.unlink()
        fsync_dir(path)
        fault("remove_after_marker", current)
    for i, child in enumerate(sorted(path.iterdir())):
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
        if i == 0:
            fault("remove_mid_files", current)
    path.rmdir()
