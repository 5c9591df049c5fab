"""One thread that reads many agent streams: every stream the head can poll
(`launcher.head.agent_link`), and a relay's streams to its children (`launcher.tree.relay`).

A thread per stream made the flat head's CPU grow faster than its hosts: at 2,048 simulated
hosts 7.2 s, at 4,096 50 s on a loaded machine (`bench.sim_scale`), most of it the interpreter
lock passed between thousands of threads that each woke for a few bytes. Here one thread waits
on every stream's descriptor at once (epoll where there is one) and hands each read's bytes to
that stream's handler, on this thread, in the order they came: what a stream delivers is in
stream order, and each stream's end is said once: None when it closed, else the error that
broke it (a read's, or its handler's: a bad frame ends that stream only, never the thread).

A stream is polled through two methods (`launcher.transport.stream.Selectable`):
``reader_fd()``, a descriptor that polls readable when there is something to read or the
stream ended, and ``read_ready(max_bytes)``, which never blocks: bytes, ``b""`` at the end,
None when there is nothing yet (a spurious wake-up, half an encrypted record). The pump polls
its own duplicate of that descriptor (taken in `add`), closed when the stream ends: an owner
that closes its descriptor meanwhile (paramiko closes a channel's pipe with the channel)
leaves the pump's open, readable at its end, never reused for another stream.

A handler that blocks (rank output into the head's full output queue) holds up every stream:
their frames wait in their transports' buffers, as one relay line's hosts do
(`launcher.tree.head.RelayLine`). ``hold`` is there to say so, so that no host is taken for
silent while the head stopped reading (`AgentLink.held`).

The thread runs while it has streams: it leaves when the last one ended, and the next `add`
starts another (a job's last stream ends after its last round; tests run many jobs).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import threading

TYPE_CHECKING = False  # `typing` costs a relay's start-up (an agent's); mypy reads True
if TYPE_CHECKING:
    from collections.abc import Callable

    from launcher.transport.stream import Selectable

    Deliver = Callable[[bytes], None]
    End = Callable[[BaseException | None], None]

READ_BYTES = 65536
#: What ends a stream when a read or its handler raises it (as a reader thread's loop ends).
BROKEN = (OSError, EOFError, ValueError)


class Hold:
    """Set while a handler waits for room in the head's output queue."""

    def __init__(self) -> None:
        self.held = False


class _Entry:
    def __init__(self, source: Selectable, deliver: Deliver, end: End) -> None:
        self.source, self.deliver, self.end = source, deliver, end
        self.fd = -1


class ReadPump:
    """Reads every stream `add`ed to it on one thread (see the module)."""

    def __init__(self) -> None:
        self.hold = Hold()  # shared by every stream's handler: one blocks them all
        self._lock = threading.Lock()
        self._pending: list[_Entry] = []
        self._count = 0  # streams added and not ended (pending included)
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1

    @property
    def streams(self) -> int:
        """Streams being read now (not ended yet)."""
        return self._count

    def add(self, source: Selectable, deliver: Deliver, end: End) -> None:
        """Read ``source`` from now on: each read's bytes to ``deliver``, and its end, once,
        to ``end`` (None, or the error that broke it). What ``source`` holds already (bytes
        read before it was added) is delivered first."""
        entry = _Entry(source, deliver, end)
        try:  # now, on the caller's thread: the owner may close its descriptor any time
            entry.fd = os.dup(source.reader_fd())
        except BROKEN as exc:
            end(exc)
            return
        with self._lock:
            self._pending.append(entry)
            self._count += 1
            if self._thread is None:
                self._wake_r, self._wake_w = os.pipe()
                os.set_blocking(self._wake_w, False)  # a full pipe wakes the thread already
                self._thread = threading.Thread(target=self._run, name="agent-streams",
                                                daemon=True)
                self._thread.start()
                return
            # Under the lock: the thread closes this pipe only under it, when it leaves.
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"\0")

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        wake = self._wake_r
        selector.register(wake, selectors.EVENT_READ, None)
        try:
            while self._take_pending(selector):
                for key, _ in selector.select():
                    if key.data is None:
                        with contextlib.suppress(BlockingIOError, OSError):
                            os.read(wake, 4096)
                        continue
                    self._serve(selector, key.data)
        finally:
            selector.close()

    def _take_pending(self, selector: selectors.BaseSelector) -> bool:
        """Register the streams added since; False (the thread leaves) when none is left."""
        with self._lock:
            new, self._pending = self._pending, []
            if not new and not self._count:
                self._thread = None
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1
                return False
        for entry in new:
            selector.register(entry.fd, selectors.EVENT_READ, entry)
            self._serve(selector, entry)  # what the stream held before it came here
        return True

    def _serve(self, selector: selectors.BaseSelector, entry: _Entry) -> None:
        """One read of ``entry``'s stream, handed over; its end said and unregistered."""
        try:
            data = entry.source.read_ready(READ_BYTES)
            if data:
                entry.deliver(data)
        except Exception as exc:  # noqa: BLE001 (a broken stream, or its handler's bug: that
            self._finish(selector, entry, exc)  # stream ends, never the others' reading)
            return
        if data is not None and not data:
            self._finish(selector, entry, None)

    def _finish(self, selector: selectors.BaseSelector, entry: _Entry,
                error: BaseException | None) -> None:
        selector.unregister(entry.fd)
        os.close(entry.fd)
        with self._lock:
            self._count -= 1
        entry.end(error)
