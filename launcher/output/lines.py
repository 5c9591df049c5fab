"""Cutting one rank's output stream into whole lines in linear time (pure: no I/O, no threads).

One `LineSplitter` per (rank, stream). `feed` scans only the bytes it is given (two ``rfind``
calls from the end), keeps the unfinished last line in a bytearray, and returns every line
completed so far as one block, so the writer makes one write per batch of lines, not one per
line. Each byte is scanned and copied a constant number of times however it is chunked, so a
64 KiB line written in 4 KiB pieces costs what 16 short lines do (the counter ``work`` lets the
tests check that).

A line ends at ``\\n``, ``\\r\\n`` or ``\\r`` (a progress bar that redraws with ``\\r`` is a
line per redraw). A ``\\r`` at the very end of a chunk is held until the next byte says whether
a ``\\n`` follows, so ``\\r\\n`` split across two reads stays one line end.

A line longer than `LINE_CAP` (1 MiB) is not held whole: it is returned in pieces of exactly
`LINE_CAP` bytes, each ended with ``\\n`` so that it is a line of its own (raw mode: nothing
added), and then its rest.
Nothing is dropped; the memory held per stream is bounded by the cap.
"""

from __future__ import annotations

import re

LINE_CAP = 1 << 20
_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")
_FIRST_END = re.compile(rb"\r\n|\r|\n")
_ENDS = (b"\r", b"\n")


class LineSplitter:
    """Whole lines out of arbitrary chunks of one stream."""

    def __init__(self, cap: int = LINE_CAP, piece_end: bytes = b"\n") -> None:
        """``piece_end`` ends each piece of an over-long line (b"" in raw mode: bytes as sent)."""
        if cap < 1:
            raise ValueError("the line cap must be at least one byte")
        self._cap = cap
        self._piece_end = piece_end
        self._partial = bytearray()
        self.work = 0  # bytes scanned plus bytes copied since creation

    @property
    def pending(self) -> int:
        """Bytes of the unfinished line held back."""
        return len(self._partial)

    def feed(self, data: bytes) -> bytes:
        """The lines ``data`` completes (with their line ends), oldest first; b"" for none."""
        self.work += len(data)
        out: list[bytes] = []
        if self._partial.endswith(b"\r") and not data.startswith(b"\n"):
            out.append(self._take())  # the held \r was a line end after all
        end = _complete_end(data)
        if end == 0:
            self._partial += data
            self.work += len(data)
            self._cut(out, complete=False)
            return self._join(out)
        first = 0
        if self._partial:
            match = _FIRST_END.search(data)  # found: end > 0 means data holds a line end
            first = match.end() if match else 0
            self._partial += data[:first]
            self.work += first
            self._cut(out, complete=True)
            out.append(self._take())
        out.append(self._capped(data[first:end]))
        self._partial += data[end:]
        self.work += len(data) - first
        self._cut(out, complete=False)
        return self._join(out)

    def rest(self, *, newline: bool) -> bytes:
        """Take the unfinished line; with ``newline``, ended with ``\\n`` if it has no end."""
        rest = self._take()
        if newline and rest and not rest.endswith(_ENDS):
            rest += b"\n"
        return rest

    def _take(self) -> bytes:
        taken = bytes(self._partial)
        self.work += len(taken)
        self._partial.clear()
        return taken

    def _cut(self, out: list[bytes], *, complete: bool) -> None:
        """Pieces of exactly ``cap`` bytes off a held line that has grown past the cap."""
        end = len(self._partial) - _end_length(self._partial) if complete else len(self._partial)
        while end > self._cap:
            out.append(bytes(memoryview(self._partial)[:self._cap]) + self._piece_end)
            del self._partial[:self._cap]  # O(1): CPython moves the start of a bytearray
            self.work += self._cap
            end -= self._cap

    def _capped(self, lines: bytes) -> bytes:
        """Whole ``lines`` as they are, unless one of them is longer than the cap (rare)."""
        if len(lines) <= self._cap:
            return lines
        pieces: list[bytes] = []
        for match in _LINE.finditer(lines):
            line = match.group(0)
            self.work += len(line)
            body = len(line) - _end_length(line)
            start = 0
            while body - start > self._cap:
                pieces.append(line[start:start + self._cap] + self._piece_end)
                start += self._cap
            pieces.append(line[start:])
        return b"".join(pieces)

    def _join(self, out: list[bytes]) -> bytes:
        joined = b"".join(out)
        self.work += len(joined)
        return joined


def _complete_end(data: bytes) -> int:
    """Where the last line known to be complete in ``data`` ends (0 when none is)."""
    end = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
    if end == len(data) and data.endswith(b"\r"):
        end = max(data.rfind(b"\n", 0, end - 1), data.rfind(b"\r", 0, end - 1)) + 1
    return end


def _end_length(line: bytes | bytearray) -> int:
    if line.endswith(b"\r\n"):
        return 2
    return 1 if line.endswith(_ENDS) else 0


_BOUNDARY = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?=.)", re.DOTALL)


def prefix_lines(block: bytes, prefix: bytes) -> bytes:
    """``prefix`` before every line of ``block``, in one pass of the regex engine; a last line
    without its end keeps every byte."""
    if not block:
        return block
    if b"\r" not in block:  # the common case, 25x faster than the regex: a C-level replace
        prefixed = prefix + block.replace(b"\n", b"\n" + prefix)
        return prefixed[:-len(prefix)] if block.endswith(b"\n") and prefix else prefixed
    escaped = prefix.replace(b"\\", b"\\\\")  # a template: only backslashes are special
    return prefix + _BOUNDARY.sub(b"\\g<0>" + escaped, block)
