"""Each host's SPEC as soon as its stream is open, and heartbeats while the others open.

The first start-up (`launcher.head.startup`) sent every SPEC once every stream was open. Over
SSH the head spends ~9 ms of CPU on each handshake: at 4,096 hosts the first agents waited
~37 s for their SPEC, and an agent leaves after 60 s without a word from its head
(`launcher.agent.main.HELLO_SILENCE_S`). Here a transport that starts hosts tells each open
stream as it comes (``opened``) and its SPEC goes at once, so its agent checks the job while
the head connects the rest; from then on it also hears a heartbeat every ``heartbeat``
seconds (an agent that read its SPEC judges its head by the job's interval).

Nothing in a SPEC waits for the other hosts but rank 0's probe (the address of host 1 as seen
from host 0, `Startup`'s), which goes once hosts 0 and 1 are both open. A SPEC too large
for a pipe's buffer (`startup.EARLY_SPEC_MAX`) still waits for its agent's HELLO. What was sent
is told to the start-up (`sent`), which sends only the rest, the same frames.

Every write of the opening phase goes under one lock (the transports' connect threads and the
heartbeat thread write to the same streams); `stop` ends the phase before the head's agent
links take the streams over.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from launcher import wire
from launcher.transport.stream import AgentStream

#: Builds host ``i``'s SPEC frame; host 0's takes the streams of hosts 0 and 1 (its probe).
SpecFor = Callable[[int, Sequence[AgentStream]], bytes | None]


class EarlySpecs:
    """The SPECs of one launch's hosts, each sent when its stream opens (see the module)."""

    def __init__(self, hosts: int, spec_for: SpecFor, heartbeat: float) -> None:
        self._hosts, self._spec_for, self._heartbeat = hosts, spec_for, heartbeat
        self._lock = threading.Lock()
        self._open: dict[int, AgentStream] = {}
        self.sent: dict[int, bytes] = {}  # host index -> the SPEC frame it was sent
        self._stop = threading.Event()
        self._beater = threading.Thread(target=self._beat, name="early-beats", daemon=True)
        self._beater.start()

    def opened(self, index: int, stream: AgentStream) -> None:
        """Host ``index``'s stream is open (a transport's connect thread): its SPEC now, or
        host 0's once host 1 is open too."""
        with self._lock:
            if self._stop.is_set():
                return
            self._open[index] = stream
            ready = [index] if index else []
            if 0 in self._open and (self._hosts == 1 or 1 in self._open):
                ready.append(0)  # its probe needs host 1's address
            for host in ready:
                if host in self.sent:
                    continue
                frame = self._spec_for(host, [self._open[i] for i in range(min(2, self._hosts))]
                                       if host == 0 else [self._open[host]])
                if frame is None:
                    continue  # too large to send before its agent reads: the start-up's
                try:
                    self._open[host].write(frame)
                except (OSError, ValueError, EOFError):
                    continue  # a broken stream shows at start-up, which sends it again
                self.sent[host] = frame

    def stop(self) -> dict[int, bytes]:
        """Every stream opened (or given up): the phase ends; the SPECs sent, by host."""
        with self._lock:
            self._stop.set()
        self._beater.join()
        return dict(self.sent)

    def _beat(self) -> None:
        beat = wire.encode(wire.Kind.HEARTBEAT)
        while not self._stop.wait(self._heartbeat):
            with self._lock:
                if self._stop.is_set():
                    return
                for stream in self._open.values():
                    try:
                        stream.write(beat)
                    except (OSError, ValueError, EOFError):
                        pass  # a broken stream shows at start-up
