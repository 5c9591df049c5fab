"""In-memory agents for the head's core tests: a byte stream pair and an agent that follows a
script, speaking the real wire protocol (`launcher.wire`) to a real `Supervisor`.

No sshd, no subprocess: the stream is a pair of in-memory pipes, the agent a thread. What the
script does with its ranks is data (`Script`): each rank's exit code, whether the agent falls
silent after START, whether it refuses its SPEC or reports an MPI_Abort.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from launcher import wire


class MemoryPipe:
    """One direction of a byte stream: blocking reads, EOF once closed and drained."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._closed = False
        self._cv = threading.Condition()

    def write(self, data: bytes) -> None:
        with self._cv:
            if self._closed:
                raise OSError("the pipe is closed")
            self._buf += data
            self._cv.notify_all()

    def read(self, max_bytes: int) -> bytes:
        with self._cv:
            self._cv.wait_for(lambda: self._buf or self._closed)
            data = bytes(self._buf[:max_bytes])
            del self._buf[:max_bytes]
            return data

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class MemoryAgentStream:
    """The head's end of an in-memory agent stream (`launcher.transport.stream.AgentStream`)."""

    is_local = False
    connection = None

    def __init__(self, host: str) -> None:
        self.host = host
        self.to_agent, self.to_head = MemoryPipe(), MemoryPipe()
        self.finished = threading.Event()

    def write(self, data: bytes) -> None:
        self.to_agent.write(data)

    def read(self, max_bytes: int = 65536) -> bytes:
        return self.to_head.read(max_bytes)

    def close(self) -> None:
        self.to_agent.close()

    def abort(self) -> None:
        self.to_agent.close()
        self.to_head.close()

    def kill(self) -> None:
        self.abort()

    def stderr_text(self) -> str:
        return ""

    def wait(self, timeout: float | None = None) -> int | None:
        return 0 if self.finished.wait(timeout) else None


@dataclass
class Script:
    """What one scripted agent does after START."""

    exit_codes: dict[int, int] = field(default_factory=dict)  # rank -> code (absent: run on)
    refuse_spec: bool = False        # answer the SPEC with ERROR instead of READY
    silent_after_start: bool = False  # stop sending anything (a cut cable)
    silent_at: float | None = None   # ... that many seconds after START instead
    silent_after_ready: bool = False  # stop sending anything once READY is sent (a spare)
    boot_s: float = 0.0              # seconds before HELLO (a slow start on a loaded host)
    save_s: float | None = None      # on KILL SIGTERM its ranks save this long, then exit 143
    abort: tuple[int, int] | None = None  # (rank, code): that rank calls MPI_Abort
    mute: bool = False               # never answer the SPEC (an agent stuck while starting)


class ScriptedAgent:
    """A thread that plays one host's agent over a `MemoryAgentStream`; ``later`` scripts the
    rounds after the first (`launcher.restart`: a SPEC after DONE), the last one repeating."""

    def __init__(self, stream: MemoryAgentStream, script: Script, *, beat: float,
                 later: tuple[Script, ...] = ()) -> None:
        self.stream, self.script, self.beat = stream, script, beat
        self.scripts, self.specs = (script, *later), []  # every SPEC received, in order
        self.received: list[wire.Kind] = []  # every frame kind the head sent, in order
        self.frames: list[wire.Frame] = []  # every frame the head sent, in order
        self.received_at: list[float] = []  # when each of them came (time.monotonic)
        self.hello_at = 0.0  # when this agent said HELLO
        self.kills: list[dict[str, Any]] = []
        self.ranks: list[int] = []
        self._running: set[int] = set()
        self._sent: dict[int, list[list[float]]] = {}  # rank -> the head's signals, as EXIT says
        self._silent = False
        self._lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True, name=f"agent-{stream.host}").start()

    def send(self, kind: wire.Kind, body: dict[str, Any] | None = None) -> None:
        with self._lock:
            if not self._silent:
                try:
                    self.stream.to_head.write(wire.encode_json(kind, body))
                except OSError:
                    pass

    def _saved(self) -> None:
        """The ranks' checkpoint is saved after a SIGTERM: they exit 143 as the trainer does."""
        for rank in sorted(self._running):
            self._exit(rank, 143, None)

    def _go_silent(self) -> None:
        with self._lock:
            self._silent = True

    def _run(self) -> None:
        time.sleep(self.script.boot_s)
        self.hello_at = time.monotonic()
        self.send(wire.Kind.HELLO, {"protocol": wire.PROTOCOL_VERSION, "dtrain": "test"})
        threading.Thread(target=self._heartbeats, daemon=True).start()
        decoder = wire.Decoder()
        try:
            while data := self.stream.to_agent.read(65536):
                for frame in decoder.feed(data):
                    self.received.append(frame.kind)
                    self.received_at.append(time.monotonic())
                    self.frames.append(frame)
                    if self._on(frame):
                        return
        finally:
            self.stream.to_head.close()
            self.stream.finished.set()

    def _heartbeats(self) -> None:
        while not self.stream.finished.is_set():
            self.send(wire.Kind.HEARTBEAT)
            time.sleep(self.beat)

    def _on(self, frame: wire.Frame) -> bool:
        kind = frame.kind
        if kind is wire.Kind.SPEC:
            self.specs.append(frame.json())
            self.ranks = [int(r["rank"]) for r in frame.json()["ranks"]]
            rounds = sum(1 for spec in self.specs if spec["ranks"])  # a spare's check: none
            self.script = self.scripts[min(max(rounds - 1, 0), len(self.scripts) - 1)]
            if self.script.mute:
                pass
            elif self.script.refuse_spec:
                self.send(wire.Kind.ERROR, {"what": "program not found", "why": "scripted"})
            else:
                self.send(wire.Kind.READY, {"ranks": len(self.ranks)})
                if self.script.silent_after_ready:
                    self._go_silent()
        elif kind is wire.Kind.START:
            self._start()
        elif kind is wire.Kind.KILL:
            self.kills.append(frame.json())
            signum = int(frame.json()["signal"])
            for rank in sorted(self._running):
                self._sent.setdefault(rank, []).append([signum, 0.0])
            if self.script.save_s is not None and signum == 15:
                threading.Timer(self.script.save_s, self._saved).start()
                return False
            for rank in sorted(self._running):
                self._exit(rank, 128 + signum, signum)
        elif kind is wire.Kind.QUERY:  # `--restart-check`: this machine's real answer
            from launcher.agent.facts import answer

            self.send(wire.Kind.REPLY, answer(frame.json()))
        elif kind is wire.Kind.BYE:
            return True
        return False

    def _start(self) -> None:
        for rank in self.ranks:
            self._running.add(rank)
            self.send(wire.Kind.STARTED, {"rank": rank, "pid": 1000 + rank})
        if self.script.silent_after_start:
            self._go_silent()
            return
        if self.script.silent_at is not None:
            threading.Timer(self.script.silent_at, self._go_silent).start()
            return
        if self.script.abort is not None:
            rank, code = self.script.abort
            self.send(wire.Kind.PMI, {"op": "abort", "rank": rank, "code": code,
                                      "message": "scripted abort"})
        for rank, code in sorted(self.script.exit_codes.items()):
            if rank in self._running:  # a script may name ranks of other hosts or rounds
                self._exit(rank, code, None)

    def _exit(self, rank: int, code: int, signum: int | None) -> None:
        self._running.discard(rank)
        self.send(wire.Kind.EXIT, {"rank": rank, "code": code, "signal": signum,
                                   "sent": self._sent.get(rank, [])})
        if not self._running:
            self.send(wire.Kind.DONE)
