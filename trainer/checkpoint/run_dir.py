"""The run dir before a run starts: checked with the options, before anything is built.

`check` refuses, on every rank and before the model or the data exist:

* a ``--run-dir`` (or its ``checkpoints`` folder) that is a file, or that this user cannot
  write (a read-only file system, or permissions): found at the first save otherwise, after
  the start-up and the first steps were spent;
* without ``--resume``, a run dir that holds committed checkpoints. A new run there would mix
  with the old one: its saves of a step the old run committed would be skipped as "already
  committed", the old run's newer steps would make pruning delete the new ones, and a later
  ``--resume`` would continue the old run. The refusal names the newest checkpoint and the
  ways out: ``--resume``, a new ``--run-dir``, or ``--overwrite``.

The checkpoint folder (`folder`) is ``<run_dir>/checkpoints`` or, when that is a symbolic link
(to a larger disk: a common setup), the folder it points to, resolved once: listing, saving,
pruning and resuming all work inside the resolved folder, where links among the steps are never
followed (`trainer.checkpoint.layout`). A link to nothing is refused here.

``--overwrite`` deletes nothing: `set_aside` (run by one rank when the run starts) moves the
previous run's ``checkpoints/`` and its records (``metrics.jsonl``, ...) into
``<run_dir>/replaced-<UTC time>-<hex>/``, where no save, prune or resume looks.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path

from trainer.checkpoint.layout import (
    CheckpointError,
    leftover_step,
    set_aside_damaged,
    step_dirs,
    stray_kind,
    strays,
)
from trainer.errors import ConfigError

CHECKPOINTS = "checkpoints"
#: Prefix of the folder ``--overwrite`` moves a previous run into.
REPLACED = "replaced-"


def folder(run_dir: Path) -> Path:
    """The run's checkpoint folder: ``<run_dir>/checkpoints``, its link resolved (docstring)."""
    path = run_dir / CHECKPOINTS
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def check(run_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse a run dir this run cannot use (module docstring); nothing is created."""
    where = f"--run-dir {run_dir}"
    link = run_dir / CHECKPOINTS
    if link.is_symlink() and not link.exists():
        raise ConfigError("checkpoint folder is missing", where,
                          f"{link} is a symbolic link to {os.readlink(link)}, which does not "
                          "exist (a disk not mounted?)",
                          "Mount or create the link's target, or remove the link")
    for path in (run_dir, run_dir / CHECKPOINTS):
        if path.exists() and not path.is_dir():
            raise ConfigError("run dir is not a folder", where, f"{path} is a file",
                              "Pass a folder for --run-dir (it is created if missing)")
    existing = next(p for p in (run_dir.absolute(), *run_dir.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError("run dir is not a folder", where, f"{existing} is a file, so the "
                          "folder cannot be created under it", "Pass another --run-dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if _read_only(existing) else \
            "is not writable by this user"
        raise ConfigError("run dir is not writable", where,
                          f"{existing} {why}, and checkpoints and metrics are written there",
                          "Pass a --run-dir on a writable file system that you own")
    found = step_dirs(folder(run_dir))
    if resume or overwrite or not found:
        return
    newest = found[max(found)]
    raise ConfigError(
        "run dir holds another run's checkpoints", where,
        f"{len(found)} committed checkpoint(s), the newest {newest}; a new run would mix its "
        "checkpoints with them (saves skipped as already committed, its own pruned, a later "
        "--resume continuing the old run)",
        "Add --resume to continue that run, pass a new --run-dir, or add --overwrite to move "
        f"its checkpoints and metrics into {run_dir}/{REPLACED}<time>/ and start anew")


def _read_only(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def set_aside(run_dir: Path, records: Sequence[str]) -> str:
    """Move the previous run's ``checkpoints/`` and ``records`` (file names in the run dir)
    into a new ``replaced-*`` folder; returns what the banner says ("" when there was none)."""
    moving = [run_dir / name for name in (CHECKPOINTS, *records)
              if (run_dir / name).exists() or (run_dir / name).is_symlink()]
    if not moving:
        return ""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside = run_dir / f"{REPLACED}{stamp}-{secrets.token_hex(2)}"
    aside.mkdir()
    for path in moving:
        path.rename(aside / path.name)  # a rename in one folder: nothing is copied or lost
    return f"--overwrite moved the previous run's {', '.join(p.name for p in moving)} to {aside}"


def unusable(root: Path) -> CheckpointError | None:
    """Why ``--resume`` may not start at step 0 in ``root``, which holds no committed checkpoint:
    checkpoint-like content it cannot use (links, files or folders of other files named like
    steps, checkpoints set aside as damaged); None when there is none."""
    found = [f"{p.name} ({stray_kind(p)})" for p in strays(root)]
    found += [f"{p.name} (set aside as damaged by --resume-fallback)"
              for p in set_aside_damaged(root)]
    if not found:
        return None
    return CheckpointError(
        "no checkpoint to resume from", str(root),
        f"--resume found no committed checkpoint it can use, only {'; '.join(found)}; starting "
        "at step 0 would abandon the run they stand for",
        "Copy a checkpoint in (a folder, not a link) and --resume again, or move them out and "
        "start the run without --resume")


def unfinished(root: Path) -> str:
    """What the banner adds about the leftovers of saves that died before their commit."""
    try:
        dead = sorted(p.name for p in root.iterdir() if leftover_step(p) is not None)
    except OSError:
        return ""
    return f" (only the unfinished save {', '.join(dead)})" if dead else ""
