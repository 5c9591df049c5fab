"""The head's output writer: one thread owns stdout/stderr; a byte-bounded queue feeds it.

Why a thread of its own: writing to a terminal or a pipe can block for as long as the reader
likes (a paused terminal, `| less`, `| (sleep 40; wc -l)`). Only this thread ever blocks on
it; the supervisor loop (heartbeats, host-loss checks, PMI, Ctrl-C) never does output I/O.

Back-pressure: each agent link's reader thread hands OUTPUT chunks to `put`, which blocks while
`limit` bytes are queued. A blocked reader stops reading its agent's stream, the SSH window
(or the pipe) fills, the agent's writer blocks, its rank pumps block, the ranks' pipes fill and
the ranks block in `write`: the job slows down to the reader's pace, nothing is dropped and
memory stays bounded. The link marks itself *held* meanwhile, so the supervisor does not take
a host whose stream we stopped reading for a silent one.

Order: a rank's exit flushes its unfinished line through the same queue (`flush_rank`), after
everything it printed; `drain` returns once everything queued so far is written, before the
exit report. A signal during the final drain may `abandon` the rest (a Ctrl-C on a stuck pipe).
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from dataclasses import dataclass

from launcher.output.sink import OutputSink

QUEUE_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class _Chunk:
    rank: int
    stream: int
    data: bytes


@dataclass(frozen=True)
class _RankExited:
    rank: int


@dataclass(frozen=True)
class _Notice:
    text: str


@dataclass(frozen=True)
class _Stop:
    """The last item: the thread leaves after writing everything before it."""


_Item = _Chunk | _RankExited | _Notice | _Stop


class OutputWriter:
    def __init__(self, limit: int = QUEUE_BYTES) -> None:
        self._limit = limit
        self._items: collections.deque[_Item] = collections.deque()
        self._queued = 0       # bytes of chunks queued or being written
        self._busy = False     # a batch is being formatted and written
        self._abandoned = False
        self._shedding = False  # a full queue drops new chunks instead of holding the reader
        self._cond = threading.Condition()
        self._sink: OutputSink | None = None
        self._thread: threading.Thread | None = None

    def start(self, sink: OutputSink) -> None:
        self._sink = sink
        self._thread = threading.Thread(target=self._run, args=(sink,), name="output-writer",
                                        daemon=True)
        self._thread.start()

    def put(self, rank: int, stream: int, data: bytes) -> None:
        """Queue a chunk of a rank's output; blocks while the queue is full (back-pressure)."""
        with self._cond:
            while self._queued >= self._limit and not (self._abandoned or self._shedding):
                self._cond.wait()
            if self._abandoned or self._queued >= self._limit:
                return  # abandoned, or shedding with a full queue: dropped
            self._items.append(_Chunk(rank, stream, data))
            self._queued += len(data)
            self._cond.notify_all()

    def flush_rank(self, rank: int) -> None:
        """The rank exited: its unfinished line goes out after all it printed. Never blocks."""
        self._add(_RankExited(rank))

    def notice(self, text: str) -> None:
        """``dtrain: text`` on stderr, in order with the output. Never blocks."""
        if self._thread is None:
            sys.stderr.write(f"dtrain: {text}\n")
            sys.stderr.flush()
            return
        self._add(_Notice(text))

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is written (or abandoned); False on timeout."""
        if self._thread is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._items or self._busy) and not self._abandoned:
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self._cond.wait(0.5)  # a timeout keeps the main thread's signal handlers live
        return True

    def shed(self) -> None:
        """From now on a full queue drops new output instead of holding its reader (a second
        Ctrl-C: the agents' exit reports wait behind their output in the same stream and must
        get through while our stdout is stuck). What is queued still drains at `close`."""
        with self._cond:
            self._shedding = True
            self._cond.notify_all()

    def abandon(self) -> None:
        """Drop what is queued and everything that comes; release blocked readers."""
        with self._cond:
            self._abandoned = True
            self._items.clear()
            self._cond.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Drain, then flush every rank's unfinished line and close the log files. What is
        not written within ``timeout`` seconds is abandoned (a second Ctrl-C: leave now)."""
        if not self.drain(timeout):
            self.abandon()
        if self._sink is not None and not self._abandoned:
            self._add(_Stop())
            if self._thread is not None:
                self._thread.join()
            self._sink.close()

    def _add(self, item: _Item) -> None:
        with self._cond:
            if not self._abandoned:
                self._items.append(item)
                self._cond.notify_all()

    def _run(self, sink: OutputSink) -> None:
        while True:
            with self._cond:
                while not self._items and not self._abandoned:
                    self._cond.wait(sink.raw_due(time.monotonic()))
                    if not self._items:
                        break  # a raw partial line is due
                if self._abandoned:
                    return
                batch = list(self._items)
                self._items.clear()
                self._busy = True
            stop = self._write(sink, batch)
            with self._cond:
                self._busy = False
                self._queued -= sum(len(i.data) for i in batch if isinstance(i, _Chunk))
                self._cond.notify_all()
            if stop:
                return

    @staticmethod
    def _write(sink: OutputSink, batch: list[_Item]) -> bool:
        """Format and write one batch; True when it held the `_Stop` item."""
        now = time.monotonic()
        stop = False
        for item in batch:
            if isinstance(item, _Chunk):
                sink.write(item.rank, item.stream, item.data, now)
            elif isinstance(item, _RankExited):
                sink.flush_rank(item.rank)
            elif isinstance(item, _Notice):
                sink.notice(item.text)
            else:
                stop = True
        sink.flush_quiet(now)
        sink.commit()
        return stop
