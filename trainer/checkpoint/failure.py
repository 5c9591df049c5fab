"""A failed save: the one error users see, and what the save left removed.

A save fails on one rank or several (a full disk, a permission, a link where the folder
should be); `agree` makes every rank of the group fail together, and rank 0 removes the
temporary folder (and the renamed, uncommitted one) once nobody writes any more: a full disk
stays full otherwise. An OSError becomes one `CheckpointError` naming the folder, why, what
is still committed and, for a full disk, how much is free.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.checkpoint.layout import CheckpointError, committed, latest, real_folder
from trainer.comm.protocol import Communicator, Handle, ReduceOp, wait_quietly

LONGEST_POLL = 1e-3
"""The longest sleep between two polls of an agreement by a rank other than the leader: polls
every 0.2 ms took 1-2 ms of CPU per rank and save in place (8 ranks on 2 cores, 2026-11-29),
from the ranks that write and the leader that commits; a wait then ends at most 1 ms late on
a rank whose next step waits for the slowest rank anyway."""


@dataclass(frozen=True)
class Posted:
    """An agreement posted and not read yet (`post`)."""

    seen: torch.Tensor
    """What every writer posted, MAXed once ``handle`` is complete."""
    handle: Handle | None
    error: CheckpointError | None
    """This writer's error of the phase (None: it succeeded)."""
    what: str


def agree(writers: Communicator, error: CheckpointError | None, tmp: Path, final: Path,
          device: torch.device, what: str, extra: Sequence[int] = ()) -> list[int]:
    """Every writer's ``error`` of a phase (None: it succeeded); if any failed, rank 0 removes
    what the save left (once nobody writes any more) and every writer raises, together: the
    lowest failing rank's message is the one printed (`TrainerError.everywhere`). ``extra``:
    the caller's own values, MAXed over the writers in the same collective (returned)."""
    return conclude(writers, post(writers, error, device, what, extra), tmp, final)


def post(writers: Communicator, error: CheckpointError | None, device: torch.device,
         what: str, extra: Sequence[int] = ()) -> Posted:
    """The first half of `agree`: this writer's part posted, not waited for."""
    rank = writers.rank
    # One MAX: whether any failed, minus the lowest failing rank, and the caller's values.
    seen = torch.tensor([int(error is not None), -rank if error else -writers.size, *extra],
                        dtype=torch.int64, device=device)
    return Posted(seen, writers.all_reduce(seen, ReduceOp.MAX, async_op=True), error, what)


def conclude(writers: Communicator, posted: Posted, tmp: Path, final: Path) -> list[int]:
    """The second half of `agree`: wait for ``posted``, raise if any writer failed, else the
    caller's values."""
    rank, error = writers.rank, posted.error
    # The leader polls often: the commit follows its wait (or nothing: every rank but it has
    # posted by then). The others wait longer (for the slowest writer, then for the commit,
    # several ms), and their polls' CPU is taken from the ranks still writing and the leader
    # (`LONGEST_POLL`).
    wait_quietly(posted.handle, longest=0.0 if rank == 0 else LONGEST_POLL)
    values = [int(v) for v in posted.seen.tolist()]
    failed, lowest = values[0], -values[1]
    if not failed:
        return values[2:]
    if rank == 0:
        discard(tmp, final)
    if error is None:
        error = CheckpointError("checkpoint save failed", str(final),
                                f"another writer (rank {lowest}) failed to {posted.what}",
                                "See its message; check free space and permissions of "
                                "--run-dir")
    raise error.everywhere(report=rank == lowest)


@contextmanager
def save_errors(tmp: Path, final: Path, *, clean: bool = True) -> Iterator[None]:
    """A failed save removes what it left (``clean``: here; else the caller does, `discard`),
    and its OSError becomes the one CheckpointError users see (`_failure`)."""
    try:
        yield
    except BaseException as exc:
        if clean:
            discard(tmp, final)
        if isinstance(exc, OSError):
            raise _failure(final, exc) from exc
        raise


def discard(tmp: Path, final: Path) -> None:
    """Remove the temporary folder of a failed save, and ``final`` if it was renamed but not
    committed: a full disk stays full otherwise. Real folders only (`layout.real_folder`);
    errors are ignored, the save's own error is the one to report."""
    for path in (tmp, final):
        if real_folder(path) and not committed(path):
            shutil.rmtree(path, ignore_errors=True)


def _failure(final: Path, exc: OSError) -> CheckpointError:
    """The error of a save that failed with ``exc``; a full disk says how much is free now."""
    root = final.parent
    newest = latest(root)
    kept = f"the newest checkpoint is {newest.name}" if newest else "no checkpoint is committed"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        full = "no space left on device" if exc.errno == errno.ENOSPC else \
            "disk quota exceeded"
        return CheckpointError(
            "checkpoint save failed", str(final),
            f"{full} ({_free(root)} free on the file system of {root} after removing the "
            f"partial save; {kept})", "Free space there, or pass a --run-dir on a larger disk, "
            "then --resume")
    return CheckpointError("checkpoint save failed", str(final),
                           f"{exc.strerror or exc} ({kept})",
                           "Check free space and permissions of --run-dir")


def _free(root: Path) -> str:
    try:
        size = float(shutil.disk_usage(root).free)
    except OSError:
        return "unknown"
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
