"""Writing a checkpoint: shards into a temporary folder, rename, commit record, prune.

The commit record (the ``COMMITTED`` marker, written last) lists every file of the folder with
its size and sha256, hashed while it was written (`trainer.checkpoint.files`). With several
writers (the tp x pp ranks of DP replica 0; under ZeRO-1 every rank, each adding its optimizer
shard as an ``extra`` file) each hashes its own files and the records are all-gathered to the
group's rank 0, which commits.
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
from trainer.checkpoint.files import FileRecord, fsync_dir, write_bytes, write_torch
from trainer.checkpoint.layout import (
    FORMAT_VERSION,
    MARKER,
    CheckpointError,
    committed,
    latest,
    real_folder,
    shard_name,
)
from trainer.checkpoint.prune import prune, remove
from trainer.comm.protocol import Communicator, ReduceOp

Records = dict[str, FileRecord]
_WORDS = 4  # int64 words of a sha256 digest
_NAME_WORDS = 8  # int64 words of a file name (64 ASCII bytes) in the gathered records


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save(root: Path, step: int, *, model: dict[str, torch.Tensor] | None,
         optim: dict[str, Any] | None, meta: dict[str, Any], keep: int = 0,
         shard: tuple[int, ...] = (0, 0), writers: Communicator | None = None,
         extra: dict[str, Any] | None = None) -> Path:
    """Write checkpoint ``step`` atomically, then prune to the newest ``keep`` (0 = keep all).

    ``shard`` is this rank's (tp, pp) model shard; ``model``/``optim`` None: this writer has
    none to write (a DP rank > 0 under ZeRO-1). ``extra``: more files of this writer, by name.
    With ``writers`` (the group of ranks that hold the different shards, every one calling
    ``save``) the call is collective: rank 0 of the group names the temporary folder and
    commits it once every file is written."""
    files = {shard_name(kind, *shard): state
             for kind, state in (("model", model), ("optim", optim)) if state is not None}
    files.update(extra or {})
    if writers is not None and writers.size > 1:
        return _save_together(root, step, files=files, meta=meta, keep=keep, writers=writers)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    if committed(final):
        return final  # the same step is already committed (e.g. resumed, then saved at the end)
    tmp = root / f"step-{step}.tmp-{secrets.token_hex(4)}"
    with _save_errors(tmp, final):
        tmp.mkdir()
        _commit(root, tmp, final, step, meta, _write_files(tmp, files, step))
        prune(root, keep=keep, current=step)
    return final


def _save_together(root: Path, step: int, *, files: dict[str, Any], meta: dict[str, Any],
                   keep: int, writers: Communicator) -> Path:
    """`save` by a group: folder named by rank 0, files written by all, commit by rank 0.
    Every phase ends with an agreement, so a failure on one rank fails every rank (no hang)."""
    final, leader = root / f"step-{step}", writers.rank == 0
    device = _device_of(files)
    token = torch.tensor([-1], dtype=torch.int64, device=device)
    if leader:
        root.mkdir(parents=True, exist_ok=True)
        if not committed(final):
            token[0] = secrets.randbits(31)
    writers.broadcast(token, 0)
    if int(token) < 0:
        return final  # already committed: nobody writes
    tmp = root / f"step-{step}.tmp-{int(token):08x}"
    mine: Records = {}
    _agreed(writers, tmp, final, device, "create the folder",
            tmp.mkdir if leader else lambda: None)
    _agreed(writers, tmp, final, device, "write its shard",
            lambda: mine.update(_write_files(tmp, files, step)))
    records = _gather_records(writers, mine, device)

    def commit() -> None:
        if leader:
            _commit(root, tmp, final, step, meta, records)
            prune(root, keep=keep, current=step)

    _agreed(writers, tmp, final, device, "commit", commit)
    return final


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


def _device_of(files: dict[str, Any]) -> torch.device:
    """Where the writers' agreement tensors live: the device of the first tensor saved."""
    for state in files.values():
        for value in state.values() if isinstance(state, dict) else ():
            if isinstance(value, torch.Tensor):
                return value.device
    return torch.device("cpu")


def _gather_records(writers: Communicator, mine: Records, device: torch.device) -> Records:
    """Every writer's file records on every writer. A file is one row of int64 words (its name,
    its size, its digest) so that any backend's all-gather carries it; each writer sends as
    many rows as the writer with the most files, unused rows all zero."""
    slots = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    writers.all_reduce(slots, ReduceOp.MAX)
    width = _NAME_WORDS + 1 + _WORDS
    rows = [[0] * width for _ in range(int(slots))]
    for row, (name, rec) in zip(rows, sorted(mine.items()), strict=False):
        raw = name.encode("ascii")
        if len(raw) > 8 * _NAME_WORDS:
            raise ValueError(f"checkpoint file name longer than {8 * _NAME_WORDS} bytes: {name}")
        row[:] = [*_words(raw.ljust(8 * _NAME_WORDS, b"\0")), rec.size,
                  *_words(bytes.fromhex(rec.sha256))]
    inp = torch.tensor(rows, dtype=torch.int64, device=device).view(-1)
    out = torch.empty(writers.size * inp.numel(), dtype=torch.int64, device=device)
    writers.all_gather(out, inp)
    records: Records = {}
    for values in out.cpu().view(-1, width).tolist():
        name = _bytes(values[:_NAME_WORDS]).rstrip(b"\0").decode("ascii")
        if name:
            records[name] = FileRecord(values[_NAME_WORDS], _bytes(values[-_WORDS:]).hex())
    return records


def _words(raw: bytes) -> list[int]:
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def _bytes(words: list[int]) -> bytes:
    return b"".join(w.to_bytes(8, "little", signed=True) for w in words)


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


def _write_files(tmp: Path, files: dict[str, Any], step: int) -> Records:
    records = {}
    for name, state in files.items():
        records[name] = write_torch(tmp / name, state)
        fault(f"save_after_{name.split('-')[0]}", step)  # save_after_model, save_after_optim
    return records


def _commit(root: Path, tmp: Path, final: Path, step: int, meta: dict[str, Any],
            shards: Records) -> None:
    """RNG and meta into ``tmp``, rename it to ``final``, then the commit record (the marker)."""
    files = dict(shards)
    files["rng.pt"] = write_torch(tmp / "rng.pt", capture_rng())
    fault("save_after_rng", step)
    body = {"format": FORMAT_VERSION, "step": step, **meta}
    files["meta.json"] = write_bytes(tmp / "meta.json",
                                     json.dumps(body, indent=2, sort_keys=True).encode())
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
