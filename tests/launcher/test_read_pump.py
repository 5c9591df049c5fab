"""One reader thread for many agent streams (`launcher.transport.pump`), on socketpairs: it
serves many streams at once, keeps each stream's bytes in order, says each end once, and leaves
when the last stream ended; the head's `AgentLink`s on pollable streams share one."""

from __future__ import annotations

import os
import socket
import threading
import time

from launcher import wire
from launcher.head.agent_link import Closed, Fleet, Received
from launcher.transport.pump import ReadPump

K = wire.Kind


class PairStream:
    """The head's end of a socketpair as a pollable agent stream; ``far`` is the agent's."""

    is_local = False
    connection = None

    def __init__(self, host: str = "node") -> None:
        self.host = host
        self.near, self.far = socket.socketpair()
        self.reads = 0

    def reader_fd(self) -> int:
        return self.near.fileno()

    def read_ready(self, max_bytes: int = 65536) -> bytes | None:
        try:
            data = self.near.recv(max_bytes, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        self.reads += 1
        return data

    def write(self, data: bytes) -> None:
        self.near.sendall(data)


class Collected:
    """What the pump handed over, per stream, and the ends it said."""

    def __init__(self) -> None:
        self.data: dict[int, bytearray] = {}
        self.ends: dict[int, list[str]] = {}
        self.lock = threading.Lock()
        self.all_ended = threading.Event()
        self.expected = 0

    def deliver(self, i: int, refuse: bytes = b"\xff"):
        def deliver(data: bytes) -> None:
            with self.lock:
                self.data.setdefault(i, bytearray()).extend(data)
            if refuse in data:
                raise ValueError("a bad frame")
        return deliver

    def end(self, i: int):
        def end(error: BaseException | None) -> None:
            with self.lock:
                self.ends.setdefault(i, []).append("closed" if error is None else str(error))
                if len(self.ends) == self.expected:
                    self.all_ended.set()
        return end


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_one_thread_serves_many_streams_each_in_order_and_says_each_end_once():
    pump, got = ReadPump(), Collected()
    streams = [PairStream(f"node{i}") for i in range(200)]
    got.expected = len(streams)
    before = threading.active_count()
    for i, stream in enumerate(streams):
        pump.add(stream, got.deliver(i), got.end(i))
    assert threading.active_count() <= before + 1  # one thread for all 200
    want = {i: bytearray() for i in range(len(streams))}
    for turn in range(20):  # interleaved writes across every stream
        for i, stream in enumerate(streams):
            piece = f"{i}:{turn};".encode() * (1 + (i * turn) % 7)
            stream.far.sendall(piece)
            want[i] += piece
    for stream in streams:
        stream.far.close()
    assert got.all_ended.wait(10)
    assert {i: bytes(d) for i, d in got.data.items()} == {i: bytes(d) for i, d in want.items()}
    assert got.ends == {i: ["closed"] for i in range(len(streams))}
    assert wait_for(lambda: pump.streams == 0 and pump._thread is None)  # it left


def test_bytes_held_before_a_stream_came_are_delivered_without_waiting_for_more():
    class Held(PairStream):
        def __init__(self) -> None:
            super().__init__()
            self.backlog = b"already read"

        def read_ready(self, max_bytes: int = 65536) -> bytes | None:
            if self.backlog:
                data, self.backlog = self.backlog, b""
                return data
            return super().read_ready(max_bytes)

    pump, got = ReadPump(), Collected()
    stream = Held()
    pump.add(stream, got.deliver(0), got.end(0))
    assert wait_for(lambda: bytes(got.data.get(0, b"")) == b"already read")
    stream.far.close()


def test_a_stream_whose_handler_refused_a_read_ends_with_why_and_the_others_go_on():
    pump, got = ReadPump(), Collected()
    quitter, other = PairStream(), PairStream()
    got.expected = 1
    pump.add(quitter, got.deliver(0), got.end(0))
    pump.add(other, got.deliver(1), got.end(1))
    quitter.far.sendall(b"bad\xff")
    assert got.all_ended.wait(5) and got.ends == {0: ["a bad frame"]}
    quitter.far.sendall(b"more")  # not read: that stream ended
    other.far.sendall(b"fine")
    assert wait_for(lambda: bytes(got.data.get(1, b"")) == b"fine")
    assert bytes(got.data[0]) == b"bad\xff"
    other.far.close()
    assert wait_for(lambda: got.ends.get(1) == ["closed"])
    assert got.ends[0] == ["a bad frame"]


class SignalledStream:
    """Like a paramiko channel: bytes in a buffer, a pipe that only signals them; closing
    the stream closes that pipe (both ends) under the pump."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        self.buffer = bytearray()
        self.closed = False

    def reader_fd(self) -> int:
        return self._r

    def read_ready(self, max_bytes: int = 65536) -> bytes | None:
        if self.buffer:
            data = bytes(self.buffer[:max_bytes])
            del self.buffer[:max_bytes]
            return data
        return b"" if self.closed else None

    def feed(self, data: bytes) -> None:
        self.buffer += data
        os.write(self._w, b"!")

    def close(self) -> None:
        self.closed = True
        os.close(self._r)
        os.close(self._w)


def test_a_stream_whose_owner_closed_its_descriptor_still_ends_on_the_pumps_copy():
    pump, got = ReadPump(), Collected()
    got.expected = 1
    stream = SignalledStream()
    pump.add(stream, got.deliver(0), got.end(0))
    stream.feed(b"last words")
    stream.close()  # the pump polls its duplicate: readable at the end, never reused
    assert got.all_ended.wait(5)
    assert bytes(got.data[0]) == b"last words"
    assert got.ends == {0: ["closed"]}


def test_a_broken_read_ends_that_stream_with_why():
    class Broken(PairStream):
        def read_ready(self, max_bytes: int = 65536) -> bytes | None:
            raise OSError("reset by peer")

    pump, got = ReadPump(), Collected()
    got.expected = 1
    stream = Broken()
    pump.add(stream, got.deliver(0), got.end(0))
    stream.far.sendall(b"x")
    assert got.all_ended.wait(5)
    assert got.ends == {0: ["reset by peer"]}


def test_agent_links_on_pollable_streams_share_the_fleets_pump_and_keep_frame_order():
    fleet = Fleet()
    outputs: list[tuple[int, bytes, int]] = []
    fleet.output = lambda out: outputs.append((out.rank, out.data, fleet.events.qsize()))
    streams = [PairStream(f"node{i}") for i in range(50)]
    before = threading.active_count()
    links = [fleet.add(s) for s in streams]  # type: ignore[arg-type]
    assert threading.active_count() <= before + 1 and fleet.pump.streams == 50
    for i, stream in enumerate(streams):
        stream.far.sendall(wire.encode_json(K.STARTED, {"rank": i}) + wire.encode_output(
            i, 1, b"hi\n") + wire.encode_json(K.EXIT, {"rank": i, "code": 0}))
        stream.far.sendall(wire.encode(K.DONE))
        stream.far.close()
    events = [fleet.events.get(timeout=5) for _ in range(4 * len(streams))]
    per_host: dict[int, list[object]] = {}
    for event in events:
        per_host.setdefault(event.host, []).append(
            event.frame.kind if isinstance(event, Received) else "closed")
    assert per_host == {i: [K.STARTED, K.EXIT, K.DONE, "closed"] for i in range(50)}
    assert sorted(rank for rank, _, _ in outputs) == list(range(50))
    assert all(isinstance(e, Closed) for e in events if not isinstance(e, Received))
    assert not any(link.held for link in links)


def test_a_link_held_on_the_full_output_queue_holds_every_link_of_its_pump():
    fleet = Fleet()
    release, entered = threading.Event(), threading.Event()

    def output(out: wire.Output) -> None:
        entered.set()
        release.wait(5)

    fleet.output = output
    a, b = PairStream("a"), PairStream("b")
    links = [fleet.add(a), fleet.add(b)]  # type: ignore[arg-type]
    a.far.sendall(wire.encode_output(0, 1, b"x"))
    assert entered.wait(5)
    assert all(link.held for link in links)  # b is not read meanwhile: not its silence
    release.set()
    assert wait_for(lambda: not any(link.held for link in links))
    a.far.close()
    b.far.close()
