"""`--pmi port` against strangers: the agent's loopback listener (`launcher.agent.pmi_sockets`)
with real sockets, as another local process would reach it."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from launcher.agent import pmi_sockets
from launcher.agent.pmi_sockets import MAX_UNAUTHENTICATED, PmiSockets


@pytest.fixture
def agent_port() -> Iterator[PmiSockets]:
    sockets = PmiSockets(mode="port", ranks=[0, 1], world_size=2, kvsname="kvs_1",
                         process_mapping="", send_head=lambda msg: None)
    yield sockets
    sockets.close()


def address(sockets: PmiSockets) -> tuple[str, int]:
    host, port = sockets.rank_env(0)["PMI_PORT"].rsplit(":", 1)
    return host, int(port)


def connect_as_rank(sockets: PmiSockets, rank: int) -> socket.socket:
    s = socket.create_connection(address(sockets), timeout=5)
    s.sendall(f"cmd=initack pmiid={sockets.rank_env(rank)['PMI_ID']}\n".encode())
    assert s.recv(4096).startswith(b"cmd=initack rc=0")
    return s


def closed_by_the_agent(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_stranger_that_keeps_sending_bytes_is_dropped_at_its_deadline(agent_port, monkeypatch):
    monkeypatch.setattr(pmi_sockets, "UNAUTHENTICATED_S", 0.5)
    stranger = socket.create_connection(address(agent_port), timeout=5)
    started = time.monotonic()
    dropped = False
    while not dropped and time.monotonic() - started < 5:
        try:
            stranger.send(b"c")  # a byte now and then: no valid PMI_ID ever
        except OSError:
            dropped = True
        time.sleep(0.1)
        dropped = dropped or closed_by_the_agent(stranger)
        stranger.setblocking(True)
    assert dropped, "a connection without a PMI_ID outlived its deadline"
    stranger.close()


def test_at_most_max_unauthenticated_strangers_are_kept_and_the_ranks_still_connect(agent_port):
    strangers = [socket.create_connection(address(agent_port), timeout=5) for _ in range(100)]
    assert wait_until(lambda: sum(not closed_by_the_agent(s) for s in strangers)
                      <= MAX_UNAUTHENTICATED)
    ranks = [connect_as_rank(agent_port, r) for r in (0, 1)]
    for s in strangers + ranks:
        s.close()


def test_the_listener_closes_once_every_rank_has_connected_and_strangers_are_dropped(agent_port):
    stranger = socket.create_connection(address(agent_port), timeout=5)
    first = connect_as_rank(agent_port, 0)
    socket.create_connection(address(agent_port), timeout=5).close()  # still open for rank 1
    second = connect_as_rank(agent_port, 1)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address(agent_port), timeout=5)
    assert wait_until(lambda: closed_by_the_agent(stranger))
    for s in (stranger, first, second):
        s.close()


def test_the_proxy_is_asked_who_holds_a_barrier_up_once_per_tenth_of_the_stall_interval():
    sent: list[dict] = []
    sockets = PmiSockets(mode="fd", ranks=[0, 1], world_size=2, kvsname="kvs_1",
                         process_mapping="", send_head=sent.append, stall_after=30.0)
    try:
        asked: list[float] = []
        held = sockets.proxy.holding_up
        sockets.proxy.holding_up = lambda host_waited=False: (  # type: ignore[method-assign]
            asked.append(time.monotonic()) or held(host_waited))
        for _ in range(1000):  # as many PMI lines as a host's ranks send in MPI_Init, at once
            sockets._report_stall()
        assert len(asked) <= 2  # ours, and maybe one of the loop's: not one per line
    finally:
        sockets.close()


class RankEnd:
    """A rank's socket as the agent writes to it: ``room`` bytes fit at once."""

    def __init__(self, room: int) -> None:
        self.room, self.calls, self.got = room, [], b""

    def send(self, data: bytes) -> int:
        self.calls.append("send")
        if not self.room:
            raise BlockingIOError
        taken = data[:self.room]
        self.got += taken
        return len(taken)

    def settimeout(self, seconds: float) -> None:
        self.calls.append(f"timeout {seconds:g}")

    def sendall(self, data: bytes) -> None:
        self.calls.append("sendall")
        self.got += data

    def setblocking(self, flag: bool) -> None:
        self.calls.append(f"blocking {flag}")


@pytest.mark.parametrize("room, calls", [
    (1000, ["send"]),  # room for all of it: one system call
    (5, ["send", "timeout 10", "sendall", "blocking False"]),  # the rest waits for room
    (0, ["send", "timeout 10", "sendall", "blocking False"]),
])
def test_a_reply_is_one_send_when_the_rank_has_room_else_the_rest_waits_for_room(
        agent_port, room, calls):
    rank = RankEnd(room)
    agent_port._reply(0, rank, b"cmd=maxes rc=0 kvsname_max=256\n")  # type: ignore[arg-type]
    assert rank.got == b"cmd=maxes rc=0 kvsname_max=256\n"
    assert rank.calls == calls
