"""The rendezvous port as anyone who can reach it sees it, on loopback: real sockets against the
head's real listener and real agents (`join`). Strangers connect from addresses of their own
(127.0.0.2 and up: all of 127/8 is loopback), so the per-address limits and lines show.

Nothing that did not prove the token ends or changes the rendezvous; idle and slow peers do
not keep an agent out; malformed frames close their connection and give back its descriptor;
an agent believes only a refusal from the head that holds the token.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher import wire
from launcher.errors import RendezvousError
from launcher.rendezvous import clear, tokens
from launcher.rendezvous.gate import Limits
from launcher.rendezvous.handshake import AgentSide
from launcher.rendezvous.join import join
from launcher.rendezvous.listener import Listener
from launcher.rendezvous.options import JoinOptions, RendezvousOptions
from launcher.rendezvous.roster import Roster
from tests.launcher.test_rendezvous_sockets import TOKEN, _join, _listener
from tests.support import PYTHON, REPO, dtrain_env

OLD_TOKEN = tokens.new().encode()


@pytest.fixture
def head(tmp_path: Path) -> Iterator[tuple[Listener, list[str]]]:
    listener, said = _listener(tmp_path)
    yield listener, said
    listener.close("the test is over")


@pytest.fixture
def many_fds() -> Iterator[None]:
    """Room for both ends of 500 connections in this one process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _connect(listener: Listener, source: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", listener.port), timeout=10,
                                    source_address=(source, 0))
    return sock


def _frame(sock: socket.socket) -> wire.Frame:
    data = b""
    while True:
        found, _ = clear.split(data)
        if found is not None:
            return found
        chunk = sock.recv(4096)
        assert chunk, "the head closed the connection instead of answering"
        data += chunk


def _closed_by_head(sock: socket.socket, within: float = 10.0) -> bool:
    """True once the head closed its end (what it sent before is read and dropped)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
    return False


def _hello(sock: socket.socket, version: int = 2) -> dict[str, object]:
    hello = {**AgentSide(OLD_TOKEN).hello(), "rendezvous": version}
    sock.sendall(wire.encode_json(wire.Kind.AUTH, hello))
    return clear.body(_frame(sock))


def _refuse_at_once(sock: socket.socket) -> None:
    sock.sendall(wire.encode_json(wire.Kind.REFUSE, {"why": "your proof is wrong"}))


def _refuse_the_challenge(sock: socket.socket) -> None:
    _hello(sock)
    sock.sendall(wire.encode_json(wire.Kind.REFUSE, {"why": "your proof is wrong"}))


def _wrong_proof(sock: socket.socket) -> None:
    _hello(sock)
    sock.sendall(wire.encode_json(wire.Kind.AUTH, {"proof": "00" * 32}))
    assert _frame(sock).kind is wire.Kind.REFUSE  # in clear: it ends nothing on either side


def _old_version(sock: socket.socket) -> None:
    assert "speaks rendezvous 1" in str(_hello(sock, version=1)["why"])


STRANGERS = [_refuse_at_once, _refuse_the_challenge, _wrong_proof, _old_version]


def test_refusals_wrong_proofs_and_old_versions_never_end_the_rendezvous_and_an_agent_joins(
        head) -> None:
    listener, said = head
    for i, stranger in enumerate(STRANGERS):
        sock = _connect(listener, f"127.0.0.{i + 2}")
        stranger(sock)
        assert _closed_by_head(sock)
        sock.close()
    with pytest.raises(RendezvousError, match="did not accept this agent's token"):
        _join(listener, timeout=1.0, token=OLD_TOKEN)  # a node with last week's token
    joined: list[object] = []
    threading.Thread(target=lambda: joined.append(_join(listener)), daemon=True).start()
    [(arrival, stream)] = listener.wait(time.monotonic() + 10, heartbeat=1.0)
    assert arrival.address == "127.0.0.1"
    lines = [line for line in said if line.startswith("ignored")]
    assert len(lines) == len(STRANGERS) + 1  # one per address, however often it tried
    assert any("127.0.0.4" in line and "does not match the head's token" in line
               for line in lines)
    stream.kill()


def test_the_rendezvous_timeout_names_the_addresses_where_agents_failed_the_token(
        tmp_path: Path) -> None:
    listener, said = _listener(tmp_path, nnodes=2)
    try:
        for _ in range(3):
            sock = _connect(listener, "127.0.0.7")
            _wrong_proof(sock)
            sock.close()
        sock = _connect(listener, "127.0.0.8")
        _old_version(sock)
        sock.close()
        joined: list[object] = []  # kept: an agent whose socket closes leaves the lobby
        threading.Thread(target=lambda: joined.append(_join(listener)), daemon=True).start()
        with pytest.raises(RendezvousError) as failed:
            listener.wait(time.monotonic() + 3, heartbeat=1.0)
    finally:
        listener.close("the test is over")
    assert "the rendezvous did not complete" in str(failed.value)
    assert "1 of 2 agents joined" in str(failed.value)
    assert "agents failed the token (or version) from 127.0.0.7 (3x), 127.0.0.8 (1x)" in str(
        failed.value)


def test_after_the_start_a_stranger_trying_100_times_makes_one_line(head) -> None:
    listener, said = head
    joined: list[object] = []
    threading.Thread(target=lambda: joined.append(_join(listener)), daemon=True).start()
    [(_, stream)] = listener.wait(time.monotonic() + 10, heartbeat=1.0)
    before = len(said)
    for _ in range(100):
        sock = _connect(listener, "127.0.0.9")
        _wrong_proof(sock)
        sock.close()
    assert len(said) - before == 1 and "127.0.0.9" in said[-1]
    stream.kill()


def _idle_or_slow(listener: Listener, n: int) -> list[socket.socket]:
    """``n`` connections from 100 addresses: a third silent, a third stopped half-way through
    a frame header, a third silent after the head's challenge."""
    socks = []
    for i in range(n):
        sock = _connect(listener, f"127.0.1.{i % 100 + 1}")
        if i % 3 == 1:
            sock.sendall(wire.encode_json(wire.Kind.AUTH, AgentSide(OLD_TOKEN).hello())[:3])
        elif i % 3 == 2:
            _hello(sock)
        socks.append(sock)
    return socks


PATIENT = Limits(preauth_s=120)  # unproved connections outlive the test however slow it runs


def test_a_real_agent_joins_while_500_idle_or_slow_connections_are_open(
        tmp_path: Path, many_fds) -> None:
    listener, said = _listener(tmp_path, limits=PATIENT)
    socks = _idle_or_slow(listener, 500)
    try:
        _until(lambda: listener.gate.pending == 500)  # under both limits: all still open
        joined: list[object] = []
        threading.Thread(target=lambda: joined.append(_join(listener, timeout=10)),
                         daemon=True).start()
        [(arrival, stream)] = listener.wait(time.monotonic() + 15, heartbeat=1.0)
        stream.kill()
        assert listener.gate.pending == 500  # it got in beside them, not instead of them
    finally:
        for sock in socks:
            sock.close()
        listener.close("the test is over")


def test_an_idle_a_stalled_and_a_silent_after_hello_connection_are_closed_after_3_s(
        head) -> None:
    listener, said = head
    socks = _idle_or_slow(listener, 3)
    try:
        assert all(_closed_by_head(sock, within=Limits.preauth_s + 10) for sock in socks)
    finally:
        for sock in socks:
            sock.close()
    assert listener.gate.pending == 0
    assert [line for line in said if "sent nothing for 3s" in line]
    assert [line for line in said if "did not prove the token within 3s" in line]


def test_one_address_holds_at_most_8_unproved_connections_the_oldest_closed_first(
        tmp_path: Path) -> None:
    listener, _ = _listener(tmp_path, limits=PATIENT)
    socks = [_connect(listener, "127.0.0.10") for _ in range(PATIENT.per_address + 2)]
    try:
        assert [_closed_by_head(s) for s in socks[:2]] == [True, True]
        _until(lambda: listener.gate.pending == PATIENT.per_address)
        assert not any(_closed_by_head(s, within=0.01) for s in socks[2:])
    finally:
        for sock in socks:
            sock.close()
        listener.close("the test is over")


def _until(condition, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "not within 10 s"
        time.sleep(0.02)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("payload", [
    b"[" * 2000 + b"]" * 2000,                        # 4 KB of nested arrays
    b"{\"rendezvous\": 2, \"nonce\": " + b"[" * 4000,    # nested and cut off
    b"\xff" * 100,                                    # not UTF-8
    b"[1, 2, 3]",                                     # JSON, not an object
])
def test_100_malformed_hellos_each_close_their_connection_and_the_fds_return(
        head, payload: bytes) -> None:
    listener, said = head
    baseline = _fds()
    for _ in range(100):
        sock = _connect(listener, "127.0.0.11")
        sock.sendall(wire.encode(wire.Kind.AUTH, payload))
        assert _closed_by_head(sock)
        sock.close()
    _until(lambda: _fds() <= baseline)
    [line] = [line for line in said if "127.0.0.11" in line]  # one line, rate-limited
    assert "Traceback" not in line and "the rendezvous goes on" in line
    _until(lambda: listener.gate.pending == 0)


class _FakeHead:
    """Whatever answers on the head's address: each connection gets ``answer``."""

    def __init__(self, answer) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._answer = answer
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                try:
                    self._answer(conn)
                    conn.recv(4096)
                except OSError:
                    pass

    def close(self) -> None:
        """Stop listening (shutdown wakes the accept, so the port is free at once)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(10)


def _refuses(conn: socket.socket) -> None:
    conn.recv(4096)
    conn.sendall(wire.encode_json(wire.Kind.REFUSE, {
        "why": "wrong token\x1b[2J\x1b[31m\rdtrain: the job finished", "fix": "give up"}))


def _bad_proof(conn: socket.socket) -> None:
    conn.recv(4096)
    conn.sendall(wire.encode_json(wire.Kind.AUTH, {"nonce": "11" * 32}))
    conn.recv(4096)
    conn.sendall(wire.encode_json(wire.Kind.AUTH, {"proof": "22" * 32}))


@pytest.mark.parametrize(("answer", "why"), [
    (_refuses, r"refused in clear \(unproved\): wrong token\\x1b\[2J\\x1b\[31m\\rdtrain"),
    (_bad_proof, "what answered does not hold this agent's token"),
])
def test_an_agent_retries_an_unproved_refusal_or_head_proof_until_its_deadline(
        answer, why: str, capfd) -> None:
    fake = _FakeHead(answer)
    try:
        with pytest.raises(RendezvousError, match=why):
            join(JoinOptions("127.0.0.1", fake.port, "unused", None, 1.5), TOKEN)
    finally:
        fake.close()
    assert fake.connections >= 2  # it tried again
    assert "\x1b" not in capfd.readouterr().err  # the agent's own lines are escaped too


def test_an_agent_refused_by_an_impostor_joins_the_real_head_that_comes_up_later(
        tmp_path: Path) -> None:
    fake = _FakeHead(_refuses)
    port = fake.port
    joined: list[object] = []
    agent = threading.Thread(target=lambda: joined.append(
        join(JoinOptions("127.0.0.1", port, "unused", None, 20), TOKEN)), daemon=True)
    agent.start()
    deadline = time.monotonic() + 10
    while fake.connections < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    fake.close()
    listener = Listener(RendezvousOptions(port=port, nnodes=1, token_file="unused",
                                          host="127.0.0.1"), TOKEN, Roster(1), lambda _: None)
    try:
        [(_, stream)] = listener.wait(time.monotonic() + 15, heartbeat=1.0)
        agent.join(10)
        assert joined and fake.connections >= 2
        stream.kill()
    finally:
        listener.close("the test is over")


HEAD_WITH_FEW_FDS = """
import resource, sys, time
from launcher.rendezvous.gate import Limits
from launcher.rendezvous.listener import Listener
from launcher.rendezvous.options import RendezvousOptions
from launcher.rendezvous.roster import Roster
resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))
opts = RendezvousOptions(port=0, nnodes=1, token_file="unused", host="127.0.0.1")
listener = Listener(opts, sys.stdin.readline().strip().encode(), Roster(1),
                    limits=Limits(preauth_s=120))
print(listener.port, flush=True)
[(arrival, stream)] = listener.wait(time.monotonic() + 30, heartbeat=1.0)
print("joined", arrival.address, flush=True)
"""


def test_a_head_out_of_file_descriptors_closes_the_oldest_stranger_and_the_agent_joins() -> None:
    """A head whose descriptor limit (48) is far below the 512 unproved connections it would
    hold: 80 idle strangers fill it, and the agent still gets in."""
    head = subprocess.Popen([PYTHON, "-c", HEAD_WITH_FEW_FDS], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env=dtrain_env())
    socks: list[socket.socket] = []
    try:
        assert head.stdin is not None and head.stdout is not None
        head.stdin.write(TOKEN.decode() + "\n")
        head.stdin.flush()
        port = int(head.stdout.readline())
        for i in range(80):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10,
                                                  source_address=(f"127.0.2.{i % 20 + 1}", 0)))
        sealed = join(JoinOptions("127.0.0.1", port, "unused", None, 15), TOKEN)
        out, err = head.communicate(timeout=30)
        sealed.sock.close()
    finally:
        for sock in socks:
            sock.close()
        if head.poll() is None:
            head.kill()
            head.communicate()
    assert head.returncode == 0, err
    assert "joined 127.0.0.1" in out
    assert "out of file descriptors" in err  # it said why strangers were closed
