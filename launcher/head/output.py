"""The ranks' output on the head: `[rank@host]` prefixes, raw passthrough, per-rank log files.

Lines are written to the terminal whole (one write per line), so output of different ranks
never mixes inside a line. A carriage return also ends a segment, so progress bars that redraw
a line with ``\\r`` appear as they are drawn instead of piling up until the next newline.
"""

from __future__ import annotations

import collections
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

_SEGMENT = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)")
TAIL_LINES = 20


class OutputSink:
    def __init__(
        self,
        rank_hosts: Mapping[int, str],
        stdout: BinaryIO,
        stderr: BinaryIO,
        *,
        prefix: bool = True,
        raw: bool = False,
        log_dir: Path | None = None,
    ) -> None:
        self._hosts = dict(rank_hosts)
        self._streams = {1: stdout, 2: stderr}
        self._prefix = prefix and not raw
        self._raw = raw
        self._partial: dict[tuple[int, int], bytes] = {}
        self._tails: dict[int, collections.deque[bytes]] = collections.defaultdict(
            lambda: collections.deque(maxlen=TAIL_LINES))
        self._logs: dict[int, BinaryIO] = {}
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            width = len(str(max(self._hosts, default=0)))
            for rank in self._hosts:
                path = log_dir / f"rank-{rank:0{width}d}.log"
                self._logs[rank] = open(path, "ab", buffering=0)  # noqa: SIM115 closed in close()

    def write(self, rank: int, stream: int, data: bytes) -> None:
        log = self._logs.get(rank)
        if log is not None:
            log.write(data)
        key = (rank, stream)
        buf = self._partial.pop(key, b"") + data
        end = 0
        for m in _SEGMENT.finditer(buf):
            self._emit(rank, stream, m.group(0))
            end = m.end()
        rest = buf[end:]
        if rest and self._raw:
            self._emit(rank, stream, rest)
        elif rest:
            self._partial[key] = rest

    def flush_rank(self, rank: int) -> None:
        """The rank exited: print what it left without a final newline."""
        for stream in (1, 2):
            rest = self._partial.pop((rank, stream), b"")
            if rest:
                self._emit(rank, stream, rest + b"\n")

    def tail(self, rank: int) -> list[str]:
        """The last stderr lines of a rank, for the exit report."""
        return [line.decode("utf-8", errors="replace").rstrip("\r\n")
                for line in self._tails.get(rank, ())]

    def close(self) -> None:
        for rank in list(self._hosts):
            self.flush_rank(rank)
        for log in self._logs.values():
            log.close()
        for out in self._streams.values():
            out.flush()

    def _emit(self, rank: int, stream: int, segment: bytes) -> None:
        if stream == 2 and segment.strip():
            self._tails[rank].append(segment)
        out = self._streams.get(stream, self._streams[1])
        if self._prefix:
            segment = f"[{rank}@{self._hosts.get(rank, '?')}] ".encode() + segment
        try:
            out.write(segment)
            out.flush()
        except BrokenPipeError:
            # `dtrain launch ... | head`: the reader left; keep supervising, stop printing.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, out.fileno())
            os.close(devnull)
