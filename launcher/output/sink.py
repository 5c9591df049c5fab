"""The ranks' output on the head: `[rank@host]` prefixes, raw passthrough, per-rank log files.

`OutputSink` formats; it is driven by one thread only, the head's output writer
(`launcher.output.writer`), which calls `write` for each chunk of a batch and then `commit`, so
each batch is one write per stream. Lines are cut by `launcher.output.lines` (linear time, a
1 MiB line cap) and a block of whole lines of one rank is never interleaved with another
rank's bytes, in every mode:

* prefixed (default): every line as ``[rank@host] line``;
* ``--no-prefix``: the lines unchanged;
* ``--raw``: the bytes unchanged; an unfinished line (a progress bar) is written once its
  rank has been quiet for `RAW_QUIET_S`, or when the rank exits.

An unfinished line of a rank that exits is printed with a ``\\n`` added (not in raw mode).
``--log-dir DIR`` writes each run into its own folder ``DIR/<job id>/rank-N.log`` (every byte,
unchanged). The last stderr lines of each rank are kept (bounded) for the exit report.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

from launcher.output.lines import LineSplitter, prefix_lines

TAIL_LINES = 20
TAIL_BYTES = 64 * 1024
RAW_QUIET_S = 0.1  # a raw partial line waits this long for the rest of its line


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
        self._raw = raw
        self._prefixes = {r: f"[{r}@{h}] ".encode() if prefix and not raw else b""
                          for r, h in self._hosts.items()}
        self._splitters: dict[tuple[int, int], LineSplitter] = {}
        self._last_data: dict[tuple[int, int], float] = {}
        self._pending: dict[int, list[bytes]] = {1: [], 2: []}
        self._tails: dict[int, bytearray] = {}
        self._logs: dict[int, BinaryIO] = {}
        self.log_dir = log_dir
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            width = len(str(max(self._hosts, default=0)))
            for rank in self._hosts:
                path = log_dir / f"rank-{rank:0{width}d}.log"
                self._logs[rank] = open(path, "ab")  # noqa: SIM115 closed in close()

    def write(self, rank: int, stream: int, data: bytes, now: float = 0.0) -> None:
        """Take a chunk of a rank's output; what it completes is written at `commit`."""
        log = self._logs.get(rank)
        if log is not None:
            try:
                log.write(data)
            except OSError as exc:
                self._log_failed(rank, exc)
        if stream == 2:
            tail = self._tails.setdefault(rank, bytearray())
            tail += data
            del tail[:-TAIL_BYTES]
        key = (rank, stream)
        splitter = self._splitters.get(key)
        if splitter is None:
            splitter = self._splitters[key] = LineSplitter(
                piece_end=b"" if self._raw else b"\n")
        self._last_data[key] = now
        self._add(rank, stream, splitter.feed(data))

    def flush_rank(self, rank: int) -> None:
        """The rank exited: what it left without a final newline goes out now."""
        for stream in (1, 2):
            splitter = self._splitters.get((rank, stream))
            if splitter is not None:
                self._add(rank, stream, splitter.rest(newline=not self._raw))

    def raw_due(self, now: float) -> float | None:
        """Seconds until a raw partial line is due to be written; None when none waits."""
        if not self._raw:
            return None
        waits = [self._last_data[k] + RAW_QUIET_S - now
                 for k, s in self._splitters.items() if s.pending]
        return max(0.0, min(waits)) if waits else None

    def flush_quiet(self, now: float) -> None:
        """Raw mode: write the partial lines of ranks quiet for `RAW_QUIET_S` (progress bars).
        Otherwise a partial line waits for its end or its rank's exit: a rank descheduled
        between writing a line and its newline (Python's ``print`` under ``-u`` writes them
        apart) would have it cut in two, the second half prefixed as a line of its own."""
        if not self._raw:
            return
        for (rank, stream), splitter in self._splitters.items():
            if splitter.pending and now >= self._last_data[rank, stream] + RAW_QUIET_S:
                self._add(rank, stream, splitter.rest(newline=False))

    def notice(self, text: str) -> None:
        """A message of dtrain's own, on stderr in order with the ranks' output."""
        self._pending[2].append(f"dtrain: {text}\n".encode())

    def commit(self) -> None:
        """Write what the last `write` calls completed: one write per stream."""
        for stream, parts in self._pending.items():
            if parts:
                self._put(self._streams[stream], b"".join(parts))
                parts.clear()
        for rank, log in list(self._logs.items()):
            try:
                log.flush()
            except OSError as exc:
                self._log_failed(rank, exc)

    def tail(self, rank: int) -> list[str]:
        """The last non-blank stderr lines of a rank, for the exit report."""
        text = bytes(self._tails.get(rank, b"")).decode("utf-8", errors="replace")
        lines = [line for line in text.splitlines() if line.strip()]
        return lines[-TAIL_LINES:]

    def close(self) -> None:
        for rank in list(self._hosts):
            self.flush_rank(rank)
        self.commit()
        for log in self._logs.values():
            log.close()
        for out in self._streams.values():
            self._put(out, b"")

    def _log_failed(self, rank: int, exc: OSError) -> None:
        """A log file that cannot be written (disk full) is closed; the job goes on."""
        log = self._logs.pop(rank)
        try:
            log.close()
        except OSError:
            pass
        self._pending[2].append(f"dtrain: writing rank-{rank}.log failed ({exc}); that log "
                                "stops here, the job goes on\n".encode())

    def _add(self, rank: int, stream: int, block: bytes) -> None:
        if not block:
            return
        prefix = self._prefixes.get(rank, b"")
        self._pending[stream if stream in self._pending else 1].append(
            prefix_lines(block, prefix) if prefix else block)

    def _put(self, out: BinaryIO, data: bytes) -> None:
        try:
            if data:
                out.write(data)
            out.flush()
        except BrokenPipeError:
            # `dtrain launch ... | head`: the reader left; keep supervising, stop printing.
            _to_devnull(out)
        except OSError as exc:
            # A full disk or a hung-up terminal: the job goes on, this stream is given up.
            _to_devnull(out)
            if out is not self._streams[2]:
                self._pending[2].append(f"dtrain: writing the ranks' output failed ({exc}); "
                                        "the rest of it is discarded, the job goes on\n".encode())


def _to_devnull(out: BinaryIO) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, out.fileno())
    os.close(devnull)
