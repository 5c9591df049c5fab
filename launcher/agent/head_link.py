"""The agent's end of the stream to the head: frames in on stdin, frames out on stdout.

The agent's real stdout is taken over for frames at start-up and fd 1 is pointed at stderr,
so a stray print in the agent (or in a library it imports) cannot corrupt the stream.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from typing import Any, BinaryIO

from launcher import wire


@dataclass(frozen=True)
class Eof:
    """The head's stream closed: the head is gone or told us to go."""

    reason: str


class HeadLink:
    """Thread-safe frame writer plus a reader thread that queues incoming frames."""

    def __init__(self, events: queue.Queue[Any]) -> None:
        self._out: BinaryIO = os.fdopen(os.dup(1), "wb", buffering=0)
        self._in_fd = os.dup(0)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(2, 1)
        self._lock = threading.Lock()
        self._events = events
        self._broken = False
        threading.Thread(target=self._read_loop, name="head-reader", daemon=True).start()

    def send(self, data: bytes) -> bool:
        """Write one encoded frame; False once the stream is broken (the head is gone)."""
        with self._lock:
            if self._broken:
                return False
            try:
                self._out.write(data)
                return True
            except OSError:
                self._broken = True
                return False

    def send_json(self, kind: wire.Kind, obj: dict[str, Any] | None = None) -> bool:
        return self.send(wire.encode_json(kind, obj))

    def _read_loop(self) -> None:
        decoder = wire.Decoder()
        reason = "the head closed the stream"
        try:
            while True:
                data = os.read(self._in_fd, 65536)
                if not data:
                    break
                for frame in decoder.feed(data):
                    self._events.put(frame)
        except (OSError, wire.WireError) as exc:
            reason = f"the stream from the head broke: {exc}"
        self._events.put(Eof(reason))
