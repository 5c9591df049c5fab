"""The head's end of one agent stream: a reader thread that routes frames, and a sender.

The reader thread hands OUTPUT frames to the output writer (`launcher.output.writer`), blocking
while its queue is full, and queues every other frame for the supervisor, in stream order, so
a rank's EXIT is seen only after all of its output was queued. Liveness is judged on what
arrives: the reader stamps ``last_heard`` on every read, and sets ``held`` while it is blocked
on our own full output queue (then the agent is not silent: we stopped listening).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
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

    def __init__(self, index: int, stream: AgentStream, events: queue.Queue[Any],
                 on_output: Callable[[wire.Output], None]) -> None:
        self.index = index
        self.stream = stream
        self.name = stream.host
        self.last_heard = time.monotonic()
        self.held = False  # the reader waits for room in our output queue
        self.alive = True
        self.hello: dict[str, Any] = {}
        # The agent's own start-up phases in seconds (`dtrain launch --timings`): boot (its
        # imports, from HELLO), check (the SPEC, from READY), spawn (its ranks, from STARTED).
        self.phases: dict[str, float] = {}
        self._events = events
        self._on_output = on_output
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
        return self.stream.stderr_text()

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
                self.last_heard = time.monotonic()
                for frame in decoder.feed(data):
                    if frame.kind is wire.Kind.OUTPUT:
                        self._output(wire.decode_output(frame))
                    else:
                        self._events.put(Received(self.index, frame))
        except (OSError, EOFError, ValueError) as exc:
            reason = f"the agent's stream broke: {exc}"
        self._events.put(Closed(self.index, reason))

    def _output(self, out: wire.Output) -> None:
        self.held = True
        try:
            self._on_output(out)  # blocks while the output queue is full
        finally:
            self.last_heard = time.monotonic()  # before `held` drops: never seen stale
            self.held = False
