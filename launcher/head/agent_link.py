"""The head's end of one agent stream: a reader thread that queues frames, and a sender."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from launcher import wire
from launcher.transport.stream import AgentStream


@dataclass(frozen=True)
class Received:
    host: int
    frame: wire.Frame


@dataclass(frozen=True)
class Closed:
    host: int
    reason: str


class AgentLink:
    """One host's agent as the supervisor sees it."""

    def __init__(self, index: int, stream: AgentStream, events: queue.Queue[Any]) -> None:
        self.index = index
        self.stream = stream
        self.name = stream.host
        self.last_heard = time.monotonic()
        self.alive = True
        self.hello: dict[str, Any] = {}
        self._events = events
        self._lock = threading.Lock()
        threading.Thread(target=self._read_loop, name=f"agent-{index}", daemon=True).start()

    def send(self, data: bytes) -> bool:
        """Send one frame; False when the stream is gone (the caller treats the host as lost)."""
        if not self.alive:
            return False
        with self._lock:
            try:
                self.stream.write(data)
                return True
            except (OSError, EOFError, ValueError):
                return False

    def send_json(self, kind: wire.Kind, obj: dict[str, Any] | None = None) -> bool:
        return self.send(wire.encode_json(kind, obj))

    def stderr_text(self) -> str:
        getter = getattr(self.stream, "stderr_text", None)
        return getter() if getter else ""

    def close(self) -> None:
        self.alive = False
        try:
            self.stream.close()
        except OSError:
            pass

    def _read_loop(self) -> None:
        decoder = wire.Decoder()
        reason = "the agent's stream closed"
        try:
            while True:
                data = self.stream.read(65536)
                if not data:
                    break
                for frame in decoder.feed(data):
                    self._events.put(Received(self.index, frame))
        except (OSError, EOFError, ValueError) as exc:
            reason = f"the agent's stream broke: {exc}"
        self._events.put(Closed(self.index, reason))
