"""Writing a checkpoint: every writer's tensor file into a temporary folder, the leader's
index, meta and RNG, rename, commit record, prune.

Every rank of the group (``world``) calls `save` together: each writes its own tensor file
(``rank-RRRRR.safetensors``, the slices it is the writer of; none when it writes nothing) and
describes it (``contents``, JSON). The descriptions and the files' records are gathered to the
leader (rank 0 of the group), which writes ``index.json`` (every file's contents),
``meta.json``, ``rng.safetensors``, renames the folder into place and writes the commit record
(the ``COMMITTED`` marker, last): the size and sha256 of every file. Every phase ends with an
agreement, so a failure on one rank fails every rank, without a hang, and the partial save is
removed.
"""

from __future__ import annotations

import errno
import json
import random
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.fault import fault
from trainer.checkpoint.files import FileRecord, fsync_dir, write_bytes, write_tensors
from trainer.checkpoint.layout import (
    FORMAT_VERSION,
    INDEX,
    MARKER,
    META,
    RNG,
    CheckpointError,
    committed,
    latest,
    rank_file,
    real_folder,
)
from trainer.checkpoint.prune import prune, remove
from trainer.comm.protocol import Communicator, ReduceOp

Records = dict[str, FileRecord]
_COMMITTED, _FAILED = -1, -2  # what the leader broadcasts instead of a folder token


def rng_state() -> tuple[dict[str, torch.Tensor], list[Any]]:
    """This process's random states: torch's (CPU, and CUDA's) as tensors, Python's as JSON."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors |= {f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    version, internal, gauss = random.getstate()
    return tensors, [version, list(internal), gauss]


def save(root: Path, step: int, *, tensors: dict[str, torch.Tensor], contents: Any,
         meta: dict[str, Any], keep: int = 0, world: Communicator | None = None,
         device: torch.device | None = None) -> Path:
    """Write checkpoint ``step`` atomically, then prune to the newest ``keep`` (0 = keep all).

    ``tensors``: this rank's tensor file (contiguous, on the CPU; empty: none), ``contents``:
    what the index says about it. Collective over ``world`` (None: this process alone);
    ``device``: where the agreements' tensors live (the communicator's device). A step already
    committed is not written again (a resumed run saving the step it resumed at)."""
    group = _Alone() if world is None else world
    device = device or torch.device("cpu")
    final, leader = root / f"step-{step}", group.rank == 0
    token = torch.tensor([_COMMITTED], dtype=torch.int64, device=device)
    error: CheckpointError | None = None
    if leader:
        try:
            with _save_errors(final, final, clean=False):
                root.mkdir(parents=True, exist_ok=True)
            if not committed(final):
                token[0] = secrets.randbits(31)
        except CheckpointError as exc:
            error, token[0] = exc, _FAILED
    group.broadcast(token, 0)
    if int(token) == _FAILED:
        raise error or CheckpointError("checkpoint save failed", str(final), "the leading "
                                       "rank could not create the folder (its message says "
                                       "why)", "Check free space and permissions of --run-dir")
    if int(token) == _COMMITTED:
        return final  # already committed: nobody writes
    tmp = root / f"step-{step}.tmp-{int(token):08x}"
    mine: Records = {}
    _agreed(group, tmp, final, device, "create the folder",
            tmp.mkdir if leader else lambda: None)

    def write() -> None:
        if tensors:
            name = rank_file(group.rank)
            mine[name] = write_tensors(tmp / name, tensors)
        fault("save_after_tensors", step)

    _agreed(group, tmp, final, device, "write its tensor file", write)
    gathered = _gather_json(group, {"files": {n: r.to_json() for n, r in mine.items()},
                                    "contents": contents if mine else None}, device)

    def commit() -> None:
        if leader:
            records = {n: FileRecord(r["size"], r["sha256"]) for g in gathered
                       for n, r in g["files"].items()}
            index = {"files": {n: g["contents"] for g in gathered for n in g["files"]}}
            _commit(root, tmp, final, step, meta, index, records)
            prune(root, keep=keep, current=step)

    _agreed(group, tmp, final, device, "commit", commit)
    return final


class _Alone:
    """The group of a process that saves alone."""

    rank, size = 0, 1

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        pass

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        pass

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        out.copy_(inp)


def _agreed(writers: Communicator, tmp: Path, final: Path, device: torch.device, what: str,
            action: Callable[[], Any]) -> None:
    """Run ``action`` on every writer; if it fails on any, rank 0 removes what the save left
    (once nobody writes any more) and every writer raises."""
    error = None
    try:
        with _save_errors(tmp, final, clean=False):
            action()
    except CheckpointError as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable state: the others wait
        error = CheckpointError("checkpoint save failed", str(tmp), f"{type(exc).__name__}: {exc}",
                                "Save only tensors and plain Python values")
    failed = torch.tensor([int(error is not None)], dtype=torch.int64, device=device)
    writers.all_reduce(failed, ReduceOp.SUM)
    if int(failed) and writers.rank == 0:
        _discard(tmp, final)
    if error is not None:
        raise error
    if int(failed):
        raise CheckpointError("checkpoint save failed", str(final),
                              f"{int(failed)} other writer(s) failed to {what}",
                              "See their messages; check free space and permissions of "
                              "--run-dir")


def _gather_json(group: Any, obj: Any, device: torch.device) -> list[Any]:
    """``obj`` (JSON) of every rank of ``group``, on every rank: its bytes as int64 words, so
    that any backend's all-gather carries them, each rank padded to the longest."""
    raw = json.dumps(obj).encode()
    words = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    group.all_reduce(words, ReduceOp.MAX)
    width = (int(words) + 7) // 8
    mine = torch.zeros(width, dtype=torch.int64)
    mine.view(torch.uint8)[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = torch.empty(group.size * width, dtype=torch.int64, device=device)
    group.all_gather(out, mine.to(device))
    return [json.loads(bytes(row.view(torch.uint8).tolist()).rstrip(b"\0"))
            for row in out.cpu().view(group.size, width)]


@contextmanager
def _save_errors(tmp: Path, final: Path, *, clean: bool = True) -> Iterator[None]:
    """A failed save removes what it left (``clean``: here; else the caller does, `_discard`),
    and its OSError becomes the one CheckpointError users see (`_failure`)."""
    try:
        yield
    except BaseException as exc:
        if clean:
            _discard(tmp, final)
        if isinstance(exc, OSError):
            raise _failure(final, exc) from exc
        raise


def _discard(tmp: Path, final: Path) -> None:
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


def _commit(root: Path, tmp: Path, final: Path, step: int, meta: dict[str, Any],
            index: dict[str, Any], written: Records) -> None:
    """Index, RNG and meta into ``tmp``, rename it to ``final``, then the commit record."""
    files = dict(written)
    files[INDEX] = write_bytes(tmp / INDEX, json.dumps(index).encode())
    rng, python = rng_state()
    files[RNG] = write_tensors(tmp / RNG, rng)
    fault("save_after_rng", step)
    body = {"format": FORMAT_VERSION, "step": step, **meta, "python_rng": python}
    files[META] = write_bytes(tmp / META, json.dumps(body, indent=2, sort_keys=True).encode())
    fsync_dir(tmp)
    fault("save_after_meta", step)
    if final.exists() or final.is_symlink():
        remove(final, step)  # an uncommitted leftover of a save that died after its rename
        # (a link there is refused, not followed)
    tmp.rename(final)
    fsync_dir(root)
    fault("save_after_rename", step)
    record = {"format": FORMAT_VERSION, "step": step,
              "files": {name: rec.to_json() for name, rec in sorted(files.items())}}
    # Written aside and renamed: a marker is whole or absent, never torn by a full disk.
    write_bytes(final / f".{MARKER}.tmp", json.dumps(record, indent=1).encode())
    (final / f".{MARKER}.tmp").rename(final / MARKER)
    fsync_dir(final)
    fault("save_after_marker", step)
