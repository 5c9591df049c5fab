"""A rendezvous connection's socket: the handshake's frames in clear (bounded in size, nesting
and time: `clear`), then the sealed stream both sides use (adapter).

`SealedSocket` is each end of the sealed stream: `read` and `write` are what the agent's
`HeadLink` and `FrameWriter` use; `RendezvousStream` is the head's `AgentStream` over it, so
the supervisor runs a joined agent exactly as one reached over SSH.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time

from launcher import wire
from launcher.errors import DtrainError
from launcher.rendezvous import clear
from launcher.rendezvous.channel import Channel
from launcher.rendezvous.handshake import HandshakeError


def prepare(sock: socket.socket) -> None:
    """No Nagle (the protocol is a ping-pong of small frames); keepalives on."""
    with contextlib.suppress(OSError):  # not TCP (a test's socketpair)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def send_clear(sock: socket.socket, kind: wire.Kind, body: dict[str, object]) -> None:
    sock.sendall(wire.encode_json(kind, body))


def read_clear(sock: socket.socket, deadline: float) -> wire.Frame:
    """The next frame in clear; HandshakeError when it is too big, malformed or late."""
    data = _recv_exact(sock, 5, deadline)
    clear.split(data)  # the length is checked before the rest is waited for
    return _one(data + _recv_exact(sock, int.from_bytes(data[:4], "big") - 1, deadline))


def _recv_exact(sock: socket.socket, count: int, deadline: float) -> bytes:
    data = b""
    while len(data) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeError("the peer did not finish the handshake in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(count - len(data))
        except TimeoutError:
            continue
        if not chunk:
            raise HandshakeError("the peer closed the connection during the handshake")
        data += chunk
    return data


class SealedSocket:
    """One end of the sealed stream: whole writes sealed under a lock, reads opened."""

    def __init__(self, sock: socket.socket, channel: Channel) -> None:
        self.sock = sock
        self._channel = channel
        self._plain = bytearray()
        self._write_lock = threading.Lock()
        self.closed = threading.Event()  # the peer closed its end (a read returned b"")

    def write(self, data: bytes | memoryview) -> int:
        with self._write_lock:
            self.sock.sendall(self._channel.seal(bytes(data)))
        return len(data)

    def send_json(self, kind: wire.Kind, body: dict[str, object] | None = None) -> None:
        self.write(wire.encode_json(kind, body))

    def read(self, max_bytes: int = 65536) -> bytes:
        """Block until some bytes are open; b"" once the peer closed (ChannelError when a
        record does not open: a WireError, as for any broken stream)."""
        while not self._plain:
            if not self._receive():
                return b""
        data = bytes(self._plain[:max_bytes])
        del self._plain[:max_bytes]
        return data

    def read_ready(self, max_bytes: int = 65536) -> bytes | None:
        """Without blocking: what is open already, else what one receive opens; b"" once the
        peer closed; None when nothing (or half a record) came."""
        if not self._plain:
            try:
                if not self._receive(socket.MSG_DONTWAIT):
                    return b""
            except BlockingIOError:
                return None
            if not self._plain:
                return None
        data = bytes(self._plain[:max_bytes])
        del self._plain[:max_bytes]
        return data

    def frame(self, deadline: float) -> wire.Frame:
        """The next whole frame (the handshake's sealed part); what follows it stays queued."""
        while True:
            if len(self._plain) >= 5:
                found, used = clear.split(self._plain)
                if found is not None:
                    del self._plain[:used]
                    return found
            left = deadline - time.monotonic()
            if left <= 0:
                raise HandshakeError("the peer did not finish the handshake in time")
            self.sock.settimeout(left)
            try:
                if not self._receive():
                    raise HandshakeError("the peer closed the connection during the handshake")
            except TimeoutError:
                continue
            finally:
                self.sock.settimeout(None)

    def alive(self) -> bool:
        """Without blocking: False once the peer has closed its end (what it sent is kept).
        poll, not select: a head holding 1,000 joined agents has sockets numbered past
        select's FD_SETSIZE (1024), where select raises (bench.sim_scale, rendezvous mode)."""
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        while poller.poll(0):
            if not self._receive():
                return False
        return True

    def _receive(self, flags: int = 0) -> bool:
        try:
            data = self.sock.recv(65536, flags)
        except ConnectionResetError:
            data = b""
        if not data:
            self.closed.set()
            return False
        self._plain += self._channel.open(data)
        return True


def _one(data: bytes) -> wire.Frame:
    found, _ = clear.split(data)
    if found is None:
        raise HandshakeError("a frame cut short")
    return found


class JoinedPeer:
    """The `connection` of a joined agent: where it connected from, the handshake's time."""

    def __init__(self, address: str, latency_ms: float, sock: socket.socket) -> None:
        self.address, self.latency_ms, self._sock = address, latency_ms, sock

    def peer_address(self) -> str:
        return self.address

    def close(self) -> None:
        """Shut down, then close: the head's pump reads a duplicate of the descriptor
        (`launcher.transport.pump`), which a close alone would leave connected."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()


class RendezvousStream:
    """AgentStream over a joined agent's sealed connection."""

    is_local = False

    def __init__(self, host: str, sealed: SealedSocket, peer: JoinedPeer) -> None:
        self.host = host
        self.sealed = sealed
        self.connection = peer

    def write(self, data: bytes) -> None:
        self.sealed.write(data)

    def read(self, max_bytes: int = 65536) -> bytes:
        return self.sealed.read(max_bytes)

    def reader_fd(self) -> int:
        return self.sealed.sock.fileno()

    def read_ready(self, max_bytes: int = 65536) -> bytes | None:
        return self.sealed.read_ready(max_bytes)

    def close(self) -> None:
        """Our end only: the agent reads EOF (and stops its ranks), we may still read."""
        with contextlib.suppress(OSError):
            self.sealed.sock.shutdown(socket.SHUT_WR)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.sealed.sock.shutdown(socket.SHUT_RDWR)

    def wait(self, timeout: float | None = None) -> int | None:
        """0 once the agent closed its end (its exit status stays on its node), else None."""
        return 0 if self.sealed.closed.wait(timeout) else None

    def kill(self) -> None:
        """The agent is not ours to kill: cut the connection (it stops its ranks on EOF)."""
        self.abort()
        self.connection.close()

    def stderr_text(self) -> str:
        """"": a joined agent's stderr is its node's (the pod log), not carried here."""
        return ""

    def transport_error(self) -> DtrainError | None:
        return None
