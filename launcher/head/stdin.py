"""The head's stdin goes to rank 0, as with mpiexec; every other rank reads /dev/null.

A thread reads fd 0 and sends STDIN frames to the agent of rank 0's host (host 0); an empty
frame is EOF, which the agent passes on by closing rank 0's stdin. Flow control is by credit:
at most `WINDOW` bytes are on their way that the agent has not yet written into rank 0's
stdin (its STDIN_ACK frames give the credit back), so a rank that never reads its stdin holds
back our reading of fd 0, never the agent's memory nor the control frames on the stream.

When stdin is a terminal in whose background dtrain runs (`dtrain launch ... &`), nothing is
read (a read would stop dtrain with SIGTTIN); rank 0 gets EOF at once.
"""

from __future__ import annotations

import os
import threading

from launcher import wire
from launcher.head.agent_link import AgentLink

WINDOW = 256 * 1024
CHUNK = 64 * 1024


class StdinForwarder:
    def __init__(self, link: AgentLink, fd: int = 0) -> None:
        self._link = link
        self._fd = fd
        self._credit = WINDOW
        self._stopped = False
        self._cond = threading.Condition()

    def start(self) -> None:
        threading.Thread(target=self._run, name="stdin", daemon=True).start()

    def acked(self, count: int) -> None:
        """The agent wrote ``count`` more bytes into rank 0's stdin."""
        with self._cond:
            self._credit += count
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _run(self) -> None:
        if not may_read(self._fd):
            self._link.send(wire.encode(wire.Kind.STDIN))
            return
        while True:
            with self._cond:
                while self._credit <= 0 and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                size = min(CHUNK, self._credit)
            try:
                data = os.read(self._fd, size)
            except OSError:
                data = b""  # stdin closed (`<&-`) or unreadable: EOF for rank 0
            with self._cond:
                self._credit -= len(data)
            if not self._link.send(wire.encode(wire.Kind.STDIN, data)) or not data:
                return


def may_read(fd: int) -> bool:
    """False when fd is a terminal whose foreground is another process group (we run in the
    background): reading it would stop the whole launcher."""
    try:
        return not os.isatty(fd) or os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return True  # let the read report it: a closed stdin reads as EOF
