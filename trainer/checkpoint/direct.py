"""Writing a checkpoint file with direct I/O: the disk reads the bytes from the process's own
memory, not from a copy in the page cache.

A buffered ``write`` copies every byte into the page cache, and the kernel's writeback then
works through those pages; for a checkpoint, written once and not read again by this process,
that copy is pure cost, paid on the cores the training computes on. Measured on the 2-core
development VM (512 MB, XXH3 in the same pass, fsync, 2026-11-28, load average 110-200): the
buffered write took 0.77-1.1 s of system CPU in the writing thread and ran at 70-99 MB/s; with
``O_DIRECT`` 0.02-0.04 s and 860-1,560 MB/s. That CPU is what made the steps slower while a
background save ran (issue 40).

Direct I/O wants the memory address, the file offset and the length of every write to be
multiples of the device's block size (`ALIGN`, a page: enough for every block size Linux
disks use). `DirectFile` takes any sequence of byte pieces and keeps the file offset aligned:
a piece that starts at an aligned address while the offset is aligned is written from where it
lies (no copy: the staged host copies of `trainer.checkpoint.pieces.stage` are one page-aligned
block laid out as the file, so all of their bytes but the edges go this way), in the same
system call as the whole blocks the bounce buffer holds before it (a file's header); the rest
passes through that page-aligned buffer. The file's end, when it is not a whole block, goes
through the page cache (`DirectFile.finish`). Where the filesystem refuses ``O_DIRECT``
(tmpfs, some network filesystems: ``EINVAL``) the file is written buffered, as before; the
bytes in the file are the same either way.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os

import numpy as np

ALIGN = 4096
"""Address, offset and length granularity of a direct write."""
BOUNCE = 8 << 20
"""Bytes of the bounce buffer: one write's worth, as `trainer.checkpoint.checksum.CHUNK`."""


def _address(piece: memoryview) -> int:
    return int(np.frombuffer(piece, dtype=np.uint8).ctypes.data)


class DirectFile:
    """A new file at ``path`` (mode 0600) written with direct I/O where the filesystem allows
    it; `write` pieces in order, `close` (after `finish`) the descriptor."""

    def __init__(self, path: os.PathLike[str] | str) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            self.fd = os.open(path, flags | os.O_DIRECT, 0o600)
            self.direct = True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.fd, self.direct = os.open(path, flags, 0o600), False
        self.size = 0  # bytes given to `write`
        self._bounce: mmap.mmap | None = None
        self._fill = 0  # bytes waiting in the bounce buffer

    def write(self, piece: memoryview) -> None:
        """Append ``piece`` to the file."""
        piece = piece.cast("B") if piece.format != "B" or piece.ndim != 1 else piece
        self.size += len(piece)
        while len(piece):
            if not self.direct:
                self._write_all(self._held(), piece)  # what the bounce buffer holds first
                self._fill = 0
                return
            if self._fill % ALIGN == 0 and self._aligned(piece):
                whole = len(piece) - len(piece) % ALIGN
                if whole:  # straight from the caller's memory, after what the bounce buffer
                    # holds (whole blocks: a file's header) in the same system call
                    self._write_all(self._held(), piece[:whole])
                    self._fill, piece = 0, piece[whole:]
                    continue
            piece = self._to_bounce(piece)

    def finish(self) -> None:
        """Write what waits in the bounce buffer: its whole blocks directly, the rest (less
        than a block: the file's end) through the page cache. Call before fsync.

        Not padded to a block and the file cut back: cutting a file inside a block has the
        kernel read that block back from the disk to zero its end (ext4), a read queued behind
        every rank's writes (measured 2 ms a file at 8 ranks, 2026-11-29), then write it
        again at the fsync; one partial page through the cache costs one write."""
        if self._fill:
            bounce = memoryview(self._buffer())
            whole = self._fill - self._fill % ALIGN
            if whole:
                self._write_all(bounce[:whole])
            if whole < self._fill:
                if self.direct:
                    self._buffered()
                self._write_all(bounce[whole:self._fill])
            self._fill = 0

    def close(self) -> None:
        """Close the file. The bounce buffer is let go, not closed: an error raised while it
        was written (ENOSPC) still holds a view of it in its traceback, and closing a mapped
        buffer with views raises a BufferError that would hide that error."""
        os.close(self.fd)
        self._bounce = None

    def _aligned(self, piece: memoryview) -> bool:
        return _address(piece) % ALIGN == 0

    def _to_bounce(self, piece: memoryview) -> memoryview:
        """Copy the head of ``piece`` into the bounce buffer, flushing it when full, up to a
        block's end when the rest of ``piece`` is aligned (so the rest goes straight, with
        the buffer, `write`); what is left of ``piece``."""
        bounce = self._buffer()
        take = min(len(piece), BOUNCE - self._fill)
        to_block = -self._fill % ALIGN
        if to_block < take and len(piece) - to_block >= ALIGN and \
                self._aligned(piece[to_block:]):
            take = to_block  # (0: the buffer ends on a block, the piece goes straight)
        bounce[self._fill:self._fill + take] = piece[:take]
        self._fill += take
        if self._fill == BOUNCE:
            self._flush()
        return piece[take:]

    def _flush(self) -> None:
        self._write_all(self._held())
        self._fill = 0

    def _held(self) -> memoryview:
        """What waits in the bounce buffer."""
        return memoryview(self._bounce or b"")[:self._fill]

    def _buffer(self) -> mmap.mmap:
        if self._bounce is None:
            self._bounce = mmap.mmap(-1, BOUNCE)  # anonymous: page-aligned
        return self._bounce

    def _write_all(self, *parts: memoryview) -> None:
        """Write ``parts`` in order, in one system call where the kernel takes them whole:
        a direct write returns once the disk has the bytes, so each call is a wait for the
        disk (a file's header written on its own cost one: 0.25 ms before its body's 12 ms
        at 6 MB, on the development VM, 2026-11-29)."""
        left = [part for part in parts if len(part)]
        while left:
            try:
                wrote = os.writev(self.fd, left)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                self._buffered()  # the filesystem took the open but refuses the write
                continue
            while left and wrote >= len(left[0]):
                wrote -= len(left.pop(0))
            if wrote:
                left[0] = left[0][wrote:]

    def _buffered(self) -> None:
        """Go on without direct I/O (when the bounce buffer was being written, the caller's
        loop goes on writing it; when it holds bytes, the next `write` sends them first)."""
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self.direct = False
