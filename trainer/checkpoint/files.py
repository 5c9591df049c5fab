"""Durable, checksummed checkpoint files: safetensors and JSON, never a pickle.

Tensors are stored as safetensors (a header of names, dtypes, shapes and offsets, then the raw
bytes): reading one back runs no code, whatever the file holds. `write_tensors` streams the
file itself rather than through ``safetensors.torch.save_file``, which has no streaming writer:
that one builds every tensor's bytes, writes them, and the checksum then had to read the file
again (a profile of an 85M-parameter save: half its time in each). Here each tensor's memory is
written and hashed chunk by chunk straight from the staged tensor (one pass, the hash reading
what the disk read, which nothing changes meanwhile), after a header padded to a page so every
chunk is a whole number of pages in the file, with direct I/O (`trainer.checkpoint.direct`: no
copy into the page cache; where the filesystem refuses it, buffered, with a helper thread
starting the disk's writeback while the next chunks are hashed, so the closing fsync has little
left). The header is the documented format (safetensors' own reader parses and checks it on
load).

Every file is fsynced and checksummed (`trainer.checkpoint.checksum`); its `FileRecord` (size,
checksum) goes into the commit record. A reader checks the size (a truncated or emptied file
fails without being read) and then the checksum before the file is parsed, so a flipped bit or
a cut-off file is refused with the file named instead of loading garbage. A tensor file is then
opened memory-mapped (`TensorFile`): a reader takes only the ranges it needs, and a file that
is not safetensors (a pickle put in its place) is one error.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError, safe_open

from trainer.checkpoint import checksum
from trainer.checkpoint.direct import DirectFile
from trainer.checkpoint.layout import (
    FALLBACK_HINT,
    PLAIN_NAME,
    CheckpointDamaged,
    CheckpointError,
)

_SHOWN = 12  # hex digits of a digest shown in messages
_PAGE = 4096  # the tensor data starts at a page boundary of the file
_FLUSH = 64 << 20  # bytes written between two starts of the disk's writeback
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
           torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
           torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
"""safetensors' names of the dtypes a checkpoint holds."""


@dataclass(frozen=True)
class FileRecord:
    """What the commit record says about one file: its size and checksum."""

    size: int
    digest: str
    algorithm: str = checksum.WRITTEN

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, self.algorithm: self.digest}


@dataclass(frozen=True)
class Image:
    """A tensor file as it lies in memory: its header, then its tensors' bytes as runs of
    back-to-back tensors (`_runs`), in the file's order."""

    header: bytes
    runs: tuple[memoryview, ...]


def image(tensors: dict[str, torch.Tensor]) -> Image:
    """The `Image` of ``tensors`` (contiguous, on the CPU)."""
    views = {key: _bytes_of(t) for key, t in tensors.items()}
    return Image(_header(tensors, views), tuple(_runs(tensors, views)))


class Images:
    """The `Image` of the tensors written last, kept while the same tensors are written
    again: a run stages every save into the same host tensors (`trainer.checkpoint.pieces`),
    and working out their header and runs anew cost a Python call per tensor each save (0.25
    of the 1.0 ms of CPU that writing a 5 MB file of 64 tensors takes, 2026-11-29), in the
    background writer, which holds the interpreter's lock meanwhile and runs at a lower
    priority (`trainer.checkpoint.writer`): a training thread that waits for that lock waits
    for the writer to be scheduled."""

    def __init__(self) -> None:
        self._tensors: tuple[torch.Tensor, ...] = ()
        self._keys: tuple[str, ...] = ()
        self._image: Image | None = None

    def __call__(self, tensors: dict[str, torch.Tensor]) -> Image:
        """The image of ``tensors``: the kept one when they are the same tensor objects
        under the same names in the same order (the kept references keep them alive, so an
        object is never another one at the same address)."""
        same = self._image is not None and tuple(tensors) == self._keys and \
            len(tensors) == len(self._tensors) and \
            all(a is b for a, b in zip(tensors.values(), self._tensors, strict=True))
        if not same or self._image is None:
            self._image = image(tensors)
            self._tensors, self._keys = tuple(tensors.values()), tuple(tensors)
        return self._image


def write_tensors(path: Path, tensors: dict[str, torch.Tensor],
                  before_sync: Callable[[], None] = lambda: None,
                  images: Images | None = None, *, sync: bool = True) -> FileRecord:
    """``tensors`` (contiguous, on the CPU) as one safetensors file, checksummed as written,
    fsynced (``sync``; else the caller fsyncs it, `fsync_all`). A failed write raises its
    OSError (e.g. a full disk). ``before_sync`` runs between the write and the fsync (a fault
    point); ``images``: where the file's `Image` is kept from one save to the next (None:
    worked out for this write)."""
    layout = images(tensors) if images is not None else image(tensors)
    digest, out = checksum.new(), DirectFile(path)
    try:
        with _writeback(out) as wrote:
            digest.update(layout.header)
            out.write(memoryview(layout.header))
            for view in layout.runs:
                for at in range(0, len(view), checksum.CHUNK):
                    piece = view[at:at + checksum.CHUNK]
                    out.write(piece)  # then hashed: the disk starts on it without waiting
                    # for the hash, which may wait for a core (8 ranks on 2 cores: 4-13 ms
                    # between a file's open and its write, 2026-11-29)
                    digest.update(piece)
                    wrote(len(piece))
            out.finish()
            before_sync()
        if sync:
            os.fsync(out.fd)
    finally:
        out.close()
    return FileRecord(out.size, digest.hexdigest())


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` (its memory, not a copy, when it is contiguous)."""
    if t.dtype not in _DTYPES:
        raise TypeError(f"a checkpoint cannot hold dtype {t.dtype}")
    flat = t.detach().reshape(-1)
    if not flat.numel():
        return memoryview(b"")
    data = flat.view(torch.uint8).numpy()
    return memoryview(data)  # type: ignore[arg-type]  # numpy exports the buffer protocol


def _runs(tensors: dict[str, torch.Tensor], views: dict[str, memoryview]) -> list[memoryview]:
    """``views`` in order, with each run of them that lies back to back in one storage (the
    staged block, `trainer.checkpoint.pieces.stage`) as one view: a direct write is a round
    trip to the disk, and one per tensor cost more than the bytes (at 5 MB in 20 tensors: two
    writes each, one for its unaligned edge, 7 ms against 3.5 for one write of the block)."""
    runs: list[tuple[torch.Tensor, int, int]] = []  # (a tensor of the storage, start, end)
    for key, t in tensors.items():
        n = len(views[key])
        if not n:
            continue
        at = t.data_ptr()
        if runs and runs[-1][2] == at and \
                runs[-1][0].untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            runs[-1] = (runs[-1][0], runs[-1][1], at + n)
        else:
            runs.append((t, at, at + n))
    out = []
    for t, start, end in runs:
        storage = t.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8).set_(storage, start - storage.data_ptr(),
                                                      (end - start,), (1,))
        out.append(memoryview(flat.numpy()))  # type: ignore[arg-type]  # a buffer
    return out


def _header(tensors: dict[str, torch.Tensor], views: dict[str, memoryview]) -> bytes:
    """safetensors' header: its length (8 bytes, little-endian), then the JSON of every
    tensor's dtype, shape and byte range, padded with spaces to end at a page boundary."""
    entries, at = {}, 0
    for key, t in tensors.items():
        entries[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [at, at + len(views[key])]}
        at += len(views[key])
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % _PAGE)
    return len(body).to_bytes(8, "little") + body


@contextmanager
def _writeback(out: DirectFile) -> Iterator[Callable[[int], None]]:
    """A callback told the bytes written; when the file is written buffered (the filesystem
    refused direct I/O), every `_FLUSH` bytes it starts an fdatasync in a helper thread (unless
    one still runs), so the disk writes while the next chunks are hashed and copied. Every
    flush's error (EIO, ENOSPC) is raised on leaving: the kernel reports a writeback error once
    per open file, possibly to the early flush rather than the last fsync."""
    flushes: list[Future[None]] = []
    pending = 0

    def wrote(n: int) -> None:
        nonlocal pending
        pending += n
        if out.direct:  # nothing waits in the page cache
            return
        if pending >= _FLUSH and (not flushes or flushes[-1].done()):
            flushes.append(pool.submit(os.fdatasync, out.fd))
            pending = 0

    with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-flush") as pool:
        yield wrote
    for flush in flushes:
        flush.result()


def write_bytes(path: Path, data: bytes, *, sync: bool = True) -> FileRecord:
    """``data`` as the file ``path``, fsynced (``sync``; else the caller fsyncs it, `fsync_all`)
    and checksummed."""
    with open(path, "wb") as fh:
        fh.write(data)
        if sync:
            _sync(fh)
    digest = checksum.new()
    digest.update(data)
    return FileRecord(len(data), digest.hexdigest())


def _sync(fh: BinaryIO) -> None:
    fh.flush()
    os.fsync(fh.fileno())


def fsync_path(path: Path) -> None:
    """Make a file's bytes, or a folder's names, durable."""
    fd = os.open(path, os.O_RDONLY)  # a file or a folder: fsync needs no write access
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_SYNCERS = 16
"""Threads of `fsync_all`, started as a commit needs them: the most paths fsynced at once (a
commit's first round: every tensor file of the leader's host, the leader's four files and the
folder)."""
_syncers: ThreadPoolExecutor | None = None


def fsync_all(paths: list[Path], started: Sequence[Future[None]] = ()) -> None:
    """fsync every file or folder of ``paths`` at once, in a pool of threads kept for the
    process (started at the first call: starting a thread waits a scheduling round, several
    ms where the ranks use every core), and return once all are durable, and those of
    ``started`` (`fsync_soon`'s; the first error raised). A journaling file system commits
    concurrent fsyncs together, so a commit waits for the disk about once rather than once
    per file (each fsync a journal commit, 1-5 ms on the development VM)."""
    for done in [*started, *fsync_soon(paths)]:
        done.result()


def fsync_soon(paths: list[Path]) -> list[Future[None]]:
    """Start fsyncing ``paths`` in `fsync_all`'s threads, without waiting; for its
    ``started``."""
    global _syncers
    if _syncers is None:
        _syncers = ThreadPoolExecutor(_SYNCERS, thread_name_prefix="checkpoint-fsync")
    return [_syncers.submit(fsync_path, path) for path in paths]


def verify_file(folder: Path, name: str, record: dict[str, FileRecord]) -> Path:
    """``folder/name`` if its size and checksum match ``record``; else CheckpointDamaged."""
    path, want = folder / name, record.get(name)

    def damaged(why: str) -> CheckpointDamaged:
        return CheckpointDamaged(f"checkpoint {folder} is damaged", f"file {name}", why,
                                 FALLBACK_HINT)

    if want is None:
        raise damaged("the commit record does not list this file (a shard of another layout, "
                      "or the record was edited)")
    if not PLAIN_NAME.match(name):
        raise damaged("the name is not a plain file name in the checkpoint folder")
    try:
        # Never through a link, never blocking on a pipe; only a regular file is read.
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as fh:
            info = os.fstat(fh.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise damaged("it is not a regular file (a device, a pipe or a folder), and is "
                              "never read")
            if info.st_size != want.size:
                raise damaged(f"it has {info.st_size:,} bytes, the commit record "
                              f"{want.size:,} (truncated, emptied or overwritten after the "
                              "save)")
            got = checksum.of_stream(fh, want.algorithm)
    except FileNotFoundError:
        raise damaged("the file is missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise damaged("it is a symbolic link, and is never followed") from None
        raise damaged(f"it cannot be read: {exc.strerror or exc}") from exc
    if got != want.digest:
        raise damaged(f"checksum mismatch ({want.algorithm}: written {want.digest[:_SHOWN]}..., "
                      f"read {got[:_SHOWN]}...): its bytes changed after the save")
    return path


class TensorFile:
    """A verified safetensors file, memory-mapped: ``read(key, lo, hi)`` copies out elements
    [lo, hi) of a flat tensor, nothing else. Refuses a file that is not safetensors."""

    def __init__(self, folder: Path, name: str, record: dict[str, FileRecord]) -> None:
        path = verify_file(folder, name, record)
        try:
            self._file = safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(
                "checkpoint file is not a safetensors file", str(path),
                f"{exc}: it may be a pickle or another format put in its place (its checksum "
                "matches, so whoever wrote it wrote the commit record too), and dtrain never "
                "unpickles a checkpoint", "Restore the checkpoint from a copy you trust, or "
                "start a new --run-dir") from None
        self.path = path

    def keys(self) -> list[str]:
        return list(self._file.keys())

    def read(self, key: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """Tensor ``key`` (its elements [lo, hi) when given: a flat tensor's range)."""
        if lo is None:
            whole: torch.Tensor = self._file.get_tensor(key)
            return whole
        part: torch.Tensor = self._file.get_slice(key)[lo:hi]
        return part
