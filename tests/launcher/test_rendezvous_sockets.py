"""The rendezvous sockets on loopback: the head's listener and agents' `join`, real TCP and
real handshakes in one process (no agent is served: what is checked is who gets a seat, and
that nothing which did not prove the token changes that)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from launcher import wire
from launcher.errors import RendezvousError
from launcher.rendezvous import tokens
from launcher.rendezvous.gate import Limits
from launcher.rendezvous.join import join
from launcher.rendezvous.listener import Listener
from launcher.rendezvous.options import JoinOptions, RendezvousOptions
from launcher.rendezvous.roster import Roster
from testbed.sshd import free_port

TOKEN = tokens.new().encode()


def _listener(tmp_path: Path, nnodes: int = 1,
              limits: Limits = Limits()) -> tuple[Listener, list[str]]:
    opts = RendezvousOptions(port=free_port(), nnodes=nnodes,
                             token_file=str(tmp_path / "unused"), host="127.0.0.1", timeout=10)
    said: list[str] = []
    return Listener(opts, TOKEN, Roster(nnodes), said.append, limits), said


@pytest.fixture
def head(tmp_path: Path):
    listener, said = _listener(tmp_path)
    yield listener, said
    listener.close("the test is over")


def _join(listener: Listener, node_rank: int | None = None, timeout: float = 5.0,
          token: bytes = TOKEN):
    return join(JoinOptions("127.0.0.1", listener.port, "unused", node_rank, timeout), token)


def test_after_the_start_an_agent_is_refused_until_a_seat_is_vacated_then_takes_it(head):
    listener, said = head
    first: list[object] = []
    threading.Thread(target=lambda: first.append(_join(listener)), daemon=True).start()
    [(arrival, stream)] = listener.wait(time.monotonic() + 10, heartbeat=1.0)
    with pytest.raises(RendezvousError, match="already started with 1 agents"):
        _join(listener)
    assert any("already started" in line for line in said)  # the head says so too
    listener.vacate(0)  # the restart hook: node 0 was given up on
    replacement = _join(listener, node_rank=0)
    seat, joined = listener.replacements.get(timeout=5)
    assert seat == 0 and joined.host == arrival.host
    replacement.send_json(wire.Kind.HEARTBEAT)
    assert wire.Decoder().feed(joined.read())[0].kind is wire.Kind.HEARTBEAT  # sealed, both ways
    for sealed in (first[0], replacement):
        sealed.sock.close()
    stream.kill()
    joined.kill()


def test_an_agent_gives_up_when_no_head_answers_before_its_deadline() -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=r"no head answered .*tried for 0.5s.*refused"):
        join(JoinOptions("127.0.0.1", port, "unused", None, 0.5), TOKEN)
    assert time.monotonic() - t0 < 5


def test_a_sealed_socket_numbered_past_1024_tells_whether_its_peer_is_alive():
    """A head with 1,000+ joined agents holds sockets numbered past select's FD_SETSIZE."""
    import os
    import resource
    import socket

    from launcher.rendezvous.channel import Channel
    from launcher.rendezvous.stream import SealedSocket

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard) <= 1100:
        pytest.skip("this process may not open a descriptor numbered past 1024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    ours, theirs = socket.socketpair()
    high = os.dup2(ours.fileno(), 1100)
    ours.close()
    sock = socket.socket(fileno=high)
    key_a, key_b = b"a" * 32, b"b" * 32
    sealed = SealedSocket(sock, Channel(send_key=key_a, receive_key=key_b))
    try:
        assert sealed.alive()
        peer = Channel(send_key=key_b, receive_key=key_a)
        theirs.sendall(peer.seal(b"hello"))
        assert sealed.alive()  # it read what arrived, and the peer is still there
        theirs.close()
        assert not sealed.alive()
    finally:
        sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
