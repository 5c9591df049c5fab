"""Names on disk: step folders, shard files, the commit marker, and the errors of checkpoints."""

from __future__ import annotations

import re
from pathlib import Path

from trainer.errors import TrainerError

#: 2: the marker holds the commit record (size and sha256 of every file). 1 had no checksums.
FORMAT_VERSION = 2
MARKER = "COMMITTED"
STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_DIR = re.compile(r"^step-(\d+)\.tmp-[0-9a-f]+$")
#: What a resume that skipped a damaged checkpoint renames it to (kept, never loaded or pruned).
DAMAGED_SUFFIX = ".damaged-"
#: The hint every refusal of a damaged checkpoint ends with.
FALLBACK_HINT = ("Restore the file from a copy, or add --resume-fallback to resume from the "
                 "newest checkpoint that verifies")


class CheckpointError(TrainerError):
    """A checkpoint cannot be written, read, or does not fit this run."""


class CheckpointDamaged(CheckpointError):
    """A committed checkpoint's files differ from its commit record (a resume may skip it)."""


def shard_name(kind: str, tp_rank: int = 0, pp_rank: int = 0, ep_rank: int = 0) -> str:
    """``ep_rank`` > 0: the experts of another expert-parallel member (`trainer.moe`)."""
    ep = f"-ep{ep_rank:02d}" if ep_rank else ""
    return f"{kind}-tp{tp_rank:02d}-pp{pp_rank:02d}{ep}.pt"


def step_dirs(root: Path) -> dict[int, Path]:
    """Committed checkpoints under ``root`` by step."""
    found = {}
    if root.is_dir():
        for child in root.iterdir():
            match = STEP_DIR.match(child.name)
            if match and (child / MARKER).is_file():
                found[int(match.group(1))] = child
    return found


def latest(root: Path) -> Path | None:
    """The newest committed checkpoint, ignoring temporaries and uncommitted folders."""
    found = step_dirs(root)
    return found[max(found)] if found else None


def leftover_step(path: Path) -> int | None:
    """The step of a temporary or uncommitted ``step-<N>`` folder (a dead save), else None."""
    tmp = TMP_DIR.match(path.name)
    if tmp:
        return int(tmp.group(1))
    bare = STEP_DIR.match(path.name)
    if bare and not (path / MARKER).exists():
        return int(bare.group(1))
    return None
