"""The agent's end of the stream to the head: frames in on stdin, frames out on stdout (or both
over a rendezvous connection's sealed socket, `launcher.rendezvous.join`).

The agent's real stdout is taken over for frames at start-up and fd 1 is pointed at stderr,
so a stray print in the agent (or in a library it imports) cannot corrupt the stream. Frames
out are written by one thread (`launcher.agent.writer`): control frames never block the
caller, rank output blocks while too much is queued (back-pressure to the ranks).
"""

from __future__ import annotations

import os
import queue
import threading
import time

from launcher import wire
from launcher.agent.writer import FrameWriter
from records import Record

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from launcher.agent.writer import ByteSink


class Eof(Record, frozen=True):
    """The head's stream closed: the head is gone or told us to go."""

    reason: str


class HeadLink:
    """The frame writer thread plus a reader thread that queues incoming frames."""

    def __init__(self, events: queue.Queue[Any], read: Callable[[int], bytes],
                 out: ByteSink) -> None:
        """Frames are read with ``read(max_bytes)`` (b"" at the end) and written to ``out``
        (both owned from now on)."""
        self._writer = FrameWriter(out)
        self._read = read
        self._events = events
        # When bytes from the head last arrived (monotonic), stamped by the reader thread: the
        # agent's silence check must not count frames that wait in its queue while its loop is
        # busy or starved (64 agents and their ranks starting on two cores) as silence.
        self.heard_at = time.monotonic()
        # Takes a frame on the reader thread instead of queueing it, when it returns True
        # (`take_on_arrival`).
        self._on_arrival: Callable[[wire.Frame], bool] | None = None
        threading.Thread(target=self._read_loop, name="head-reader", daemon=True).start()

    @classmethod
    def over_stdio(cls, events: queue.Queue[Any]) -> HeadLink:
        """The link over the agent's own stdin/stdout, which it takes over for frames."""
        out = os.fdopen(os.dup(1), "wb", buffering=0)
        in_fd = os.dup(0)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(2, 1)
        return cls(events, lambda size: os.read(in_fd, size), out)

    def take_on_arrival(self, take: Callable[[wire.Frame], bool]) -> None:
        """Let ``take`` handle frames on the reader thread as they arrive (it returns False
        for those the agent's loop is to handle, queued in order). For PMI answers: a rank
        waits for each (MPICH's gets are serial; on 64 namespace hosts ranks in MPI_Init
        were seen spinning in sched_yield meanwhile), and on a loaded host each thread an
        answer passes adds a wake-up's delay; set before any frame it would take can arrive
        (the order with the queued ones is then kept)."""
        self._on_arrival = take

    def send(self, data: bytes) -> bool:
        """Queue one encoded control frame; never blocks. False once the stream is broken."""
        return self._writer.send(data)

    def forward(self, data: bytes) -> bool:
        """Whole frames a relay carries up, written by the calling thread while nothing else
        is queued (`FrameWriter.forward`: may block; never from the agent's loop)."""
        return self._writer.forward(data)

    def send_output(self, rank: int, stream: int, data: bytes) -> bool:
        """Queue a rank's output; blocks while the output queue is full (back-pressure)."""
        return self._writer.send_output(wire.encode_output(rank, stream, data))

    def send_output_frame(self, frame: bytes) -> bool:
        """An encoded frame carrying rank output (a relayed host's), back-pressured likewise."""
        return self._writer.send_output(frame)

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for everything queued to reach the stream."""
        return self._writer.flush(timeout)

    def send_json(self, kind: wire.Kind, obj: dict[str, Any] | None = None) -> bool:
        return self.send(wire.encode_json(kind, obj))

    def _read_loop(self) -> None:
        decoder = wire.Decoder()
        reason = "the head closed the stream"
        try:
            while True:
                data = self._read(65536)
                if not data:
                    break
                self.heard_at = time.monotonic()
                take = self._on_arrival
                for frame in decoder.feed(data):
                    if take is None or not take(frame):
                        self._events.put(frame)
        except (OSError, wire.WireError) as exc:
            reason = f"the stream from the head broke: {exc}"
        self._events.put(Eof(reason))
