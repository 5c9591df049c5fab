"""The agent's frame writer: one thread writes the stream to the head, one write at a time.

Everything the agent sends goes through one FIFO queue, so frames keep their order (a rank's
EXIT after all of its OUTPUT, DONE after every EXIT). Three kinds of callers:

* control frames (`send`: heartbeats, PMI, STARTED, EXIT, DONE) never block: the agent's main
  loop must stay free to act on KILL and to stop ranks whatever the stream does;
* rank output (`send_output`) blocks while `limit` bytes of output are queued. The rank's pump
  thread then stops reading the rank's pipe, the pipe fills and the rank blocks in `write`:
  back-pressure from a slow head (its stdout reader) to the ranks, with bounded memory;
* a relay's reading thread (`forward`: its children's frames) writes them itself while the
  queue is empty and nothing is being written (the thread waits meanwhile), else queues them:
  a frame crossing a relay wakes no writer thread (`launcher.tree.upstream`).

The thread batches whatever is queued into one write. When the stream breaks (the head is
gone) everything queued is dropped and blocked pumps are released; the reader thread's EOF
tells the main loop.
"""

from __future__ import annotations

import collections
import threading
import time

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from typing import Protocol

    class ByteSink(Protocol):
        """Where frames go: a pipe or file (stdout), or a rendezvous connection's sealed socket."""

        def write(self, data: memoryview, /) -> int:
            """Write some of ``data``; the number of bytes written."""

OUTPUT_QUEUE_BYTES = 1024 * 1024


class FrameWriter:
    def __init__(self, out: ByteSink, limit: int = OUTPUT_QUEUE_BYTES) -> None:
        self._out = out
        self._limit = limit
        self._frames: collections.deque[tuple[bytes, bool]] = collections.deque()
        self._output_bytes = 0   # rank output queued or being written
        self._busy = False
        self.broken = False
        self._cond = threading.Condition()
        threading.Thread(target=self._run, name="head-writer", daemon=True).start()

    def send(self, frame: bytes) -> bool:
        """Queue a control frame; never blocks. False once the stream is broken."""
        return self._queue(frame, output=False)

    def forward(self, data: bytes) -> bool:
        """Write ``data`` (whole frames) on the caller's thread when nothing is queued or being
        written, else queue it behind what is; may block while the stream is full (a relay's
        reading thread: its wait is back-pressure on the children it reads). False once
        broken."""
        with self._cond:
            if self.broken:
                return False
            if self._frames or self._busy:
                self._frames.append((data, False))
                self._cond.notify_all()
                return True
            self._busy = True  # the writer thread waits meanwhile: the frames' order holds
        try:
            self._write_all(data)
        except (OSError, ValueError):
            self._broke()
            return False
        with self._cond:
            self._busy = False
            self._cond.notify_all()
        return True

    def send_output(self, frame: bytes) -> bool:
        """Queue an OUTPUT frame; blocks while the output queue is full. False once broken."""
        return self._queue(frame, output=True)

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until everything queued is written."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._frames or self._busy) and not self.broken:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return not self.broken

    def _queue(self, frame: bytes, *, output: bool) -> bool:
        with self._cond:
            while output and self._output_bytes >= self._limit and not self.broken:
                self._cond.wait()
            if self.broken:
                return False
            self._frames.append((frame, output))
            if output:
                self._output_bytes += len(frame)
            self._cond.notify_all()
            return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while (not self._frames or self._busy) and not self.broken:
                    self._cond.wait()
                if self.broken:
                    return
                batch = list(self._frames)
                self._frames.clear()
                self._busy = True
            try:
                self._write_all(b"".join(frame for frame, _ in batch))
            except (OSError, ValueError):
                self._broke()
                return
            with self._cond:
                self._busy = False
                self._output_bytes -= sum(len(f) for f, output in batch if output)
                self._cond.notify_all()

    def _broke(self) -> None:
        with self._cond:
            self.broken, self._busy = True, False
            self._frames.clear()
            self._cond.notify_all()

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[self._out.write(view):]  # an unbuffered file may write a part
