"""Names on disk: step folders, tensor files, the commit marker, and the errors of checkpoints."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from trainer.errors import TrainerError

#: 4: the commit record's checksums are XXH3-128 (`trainer.checkpoint.checksum`); 3 (still
#: read): sha256, else the same safetensors and JSON files, one tensor file per writing rank,
#: an index of placements. 2 pickled each (tp, pp) shard; 1 had no checksums.
FORMAT_VERSION = 4
MARKER = "COMMITTED"
META = "meta.json"
INDEX = "index.json"
RNG = "rng.safetensors"
#: The files every checkpoint has besides the tensor files of its writers.
REQUIRED = (META, INDEX, RNG)
STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_DIR = re.compile(r"^step-(\d+)\.tmp-[0-9a-f]+$")
#: What a resume that skipped a damaged checkpoint renames it to (kept, never loaded or pruned).
DAMAGED_SUFFIX = ".damaged-"
DAMAGED_DIR = re.compile(r"^step-(\d+)\.damaged-[0-9a-f]+$")
#: Every name a save writes into a checkpoint folder: a folder named like a step that holds
#: anything else is not a dead save, and nothing in it but these files is ever deleted.
OWN_FILE = re.compile(r"^(rank-\d{5,}\.safetensors|rank-\d{5,}\.json|index\.json|meta\.json"
                      r"|rng\.safetensors|COMMITTED|\.COMMITTED\.tmp)$")
#: What a file name in a commit record or an index may be: a plain name in the checkpoint
#: folder (no separator, no ``..``, not hidden), so a reader never leaves the folder.
PLAIN_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}$")
#: The hint every refusal of a damaged checkpoint ends with.
FALLBACK_HINT = ("Restore the file from a copy, or add --resume-fallback to resume from the "
                 "newest checkpoint that verifies")


class CheckpointError(TrainerError):
    """A checkpoint cannot be written, read, or does not fit this run."""


class CheckpointDamaged(CheckpointError):
    """A committed checkpoint's files differ from its commit record (a resume may skip it)."""


def rank_file(rank: int) -> str:
    """The tensor file global rank ``rank`` writes (the slices it is the writer of)."""
    return f"rank-{rank:05d}.safetensors"


def real_folder(path: Path) -> bool:
    """A folder itself, not a symbolic link to one (``lstat``: the link is never followed)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def committed(path: Path) -> bool:
    """``path`` is a real folder holding a commit record that is a regular file (no link)."""
    try:
        return real_folder(path) and stat.S_ISREG(os.lstat(path / MARKER).st_mode)
    except OSError:
        return False


def _named_like_steps(root: Path) -> list[Path]:
    """Entries of ``root`` named like a checkpoint or one of its temporaries, sorted."""
    try:
        names = os.listdir(root) if real_folder(root) else []
    except OSError:
        names = []
    return sorted(root / n for n in names if STEP_DIR.match(n) or TMP_DIR.match(n))


def foreign(path: Path) -> list[str]:
    """The entries of the real folder ``path`` that no save writes (sorted; a folder among
    them, whatever its name, too): none in a checkpoint or in the leftover of a dead save."""
    try:
        names = os.listdir(path) if real_folder(path) else []
    except OSError:
        return []
    return sorted(n for n in names if not OWN_FILE.match(n) or real_folder(path / n))


def step_dirs(root: Path) -> dict[int, Path]:
    """Committed checkpoints under ``root`` by step. Only real folders count: a symbolic link or
    a file named ``step-<N>`` is never listed (`strays`), so nothing reads or deletes through it."""
    found = {}
    for child in _named_like_steps(root):
        match = STEP_DIR.match(child.name)
        if match and committed(child):
            found[int(match.group(1))] = child
    return found


def strays(root: Path) -> list[Path]:
    """Entries named like checkpoints that are links, not folders, or uncommitted folders
    holding files no save writes: reported, never touched."""
    return [child for child in _named_like_steps(root) if not real_folder(child)
            or (not committed(child) and foreign(child))]


def stray_kind(path: Path) -> str:
    """What a stray (`strays`) is, in words."""
    if path.is_symlink():
        return f"a symbolic link to {os.readlink(path)}"
    if not real_folder(path):
        return "not a folder"
    names = foreign(path)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"a folder holding what no save writes ({shown})"


def set_aside_damaged(root: Path) -> list[Path]:
    """The damaged checkpoints a ``--resume-fallback`` renamed (``step-<N>.damaged-<hex>``)."""
    try:
        names = os.listdir(root) if real_folder(root) else []
    except OSError:
        names = []
    return sorted(root / n for n in names if DAMAGED_DIR.match(n))


def latest(root: Path) -> Path | None:
    """The newest committed checkpoint, ignoring temporaries and uncommitted folders."""
    found = step_dirs(root)
    return found[max(found)] if found else None


def leftover_step(path: Path) -> int | None:
    """The step of a temporary or uncommitted ``step-<N>`` folder (a dead save), else None.
    A link, a file or a folder holding anything a save does not write is never a leftover
    (`strays`)."""
    if not real_folder(path) or foreign(path):
        return None
    tmp = TMP_DIR.match(path.name)
    if tmp:
        return int(tmp.group(1))
    bare = STEP_DIR.match(path.name)
    if bare and not committed(path):
        return int(bare.group(1))
    return None
