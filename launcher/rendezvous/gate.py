"""The rendezvous port's gate: every connection until it has proved the token, all in one
thread (adapter: sockets, selectors).

Anyone who reaches the port can connect, so an unproved connection costs the head one file
descriptor and a few hundred bytes here, never a thread or a place a real agent needs
(`Limits`): it has `preauth_s` from accept to its proof, one address holds at most
`per_address` unproved connections and all addresses together `pending`, and when a new one
comes over either limit the oldest of them is closed (an agent's whole handshake takes
milliseconds; what is oldest is what idles). A connection that fails anything (a malformed or
oversized frame, another version, a wrong proof, silence) is closed and reported to ``note``
(the listener's `Strangers` decide what is printed); nothing it sends changes the rendezvous.
One that proved the token is handed to ``on_pass`` with its channel, blocking again, out of
this thread.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from launcher import wire
from launcher.rendezvous import clear
from launcher.rendezvous.channel import Channel
from launcher.rendezvous.handshake import AuthError, HandshakeError, HeadSide
from launcher.rendezvous.stream import prepare

_ACCEPTS = 64          # accepts per wake-up, so reading the others is never starved
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
TOKEN_FIX = "give every agent the head's token file (--token-file or DTRAIN_RDZV_TOKEN_FILE)"
VERSION_FIX = "install the same dtrain version on every node"

#: (socket, its address, the sealed channel's keys, when it was accepted)
Pass = Callable[[socket.socket, str, Channel, float], None]
#: (address, why it was dropped, whether a dtrain agent failed the token or version)
Note = Callable[[str, str, bool], None]


@dataclass(frozen=True)
class Limits:
    """What an unproved connection may hold (the defaults are the head's)."""

    preauth_s: float = 3.0   # from accept to the agent's proof: two round trips of small frames
    per_address: int = 8     # unproved connections from one address at once
    pending: int = 512       # unproved connections at once, all addresses together


@dataclass(eq=False)
class _Peer:
    sock: socket.socket
    address: str
    since: float
    head: HeadSide
    received: bytearray = field(default_factory=bytearray)
    challenged: bool = False
    spoke: bool = False          # it sent a byte (a bare connect and close is a port check)


class Gate:
    def __init__(self, sock: socket.socket, token: bytes, on_pass: Pass, note: Note,
                 limits: Limits = Limits()) -> None:
        self._listen, self._token, self.limits = sock, token, limits
        self._on_pass, self._note = on_pass, note
        self._peers: dict[socket.socket, _Peer] = {}  # in the order they came: oldest first
        self._per_address: Counter[str] = Counter()
        self._selector = selectors.DefaultSelector()
        self._wake, self._waker = socket.socketpair()
        self._closed = False
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ, None)
        self._selector.register(self._wake, selectors.EVENT_READ, self._wake)
        self._thread = threading.Thread(target=self._run, name="rendezvous-gate", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting; the gate's thread closes the port and every unproved connection."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._waker.send(b"\0")
        if threading.current_thread() is not self._thread:
            self._thread.join(5)

    @property
    def pending(self) -> int:
        """Unproved connections open now."""
        return len(self._peers)

    def _run(self) -> None:
        try:
            while not self._closed:
                oldest = next(iter(self._peers.values()), None)
                wait = 1.0 if oldest is None else (oldest.since + self.limits.preauth_s
                                                   - time.monotonic())
                for key, _ in self._selector.select(min(1.0, max(0.0, wait))):
                    if key.data is None:
                        self._accept()
                    elif isinstance(key.data, _Peer):
                        self._read(key.data)
                self._expire(time.monotonic())
        finally:
            for peer in list(self._peers.values()):
                self._drop(peer, "")
            self._selector.close()
            for sock in (self._listen, self._wake, self._waker):
                sock.close()

    def _accept(self) -> None:
        for _ in range(_ACCEPTS):
            try:
                conn, addr = self._listen.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno not in _OUT_OF_FDS:
                    continue  # that one connection went wrong (reset before accept)
                oldest = next(iter(self._peers.values()), None)
                if oldest is None:
                    time.sleep(0.1)  # out of descriptors for other reasons: try again soon
                else:
                    self._drop(oldest, "closed to make room: the head is out of file "
                               "descriptors")
                return
            self._admit(conn, _address(addr))

    def _admit(self, conn: socket.socket, address: str) -> None:
        most = self.limits
        if self._per_address[address] >= most.per_address:
            self._drop(next(p for p in self._peers.values() if p.address == address),
                       f"more than {most.per_address} unproved connections at once from one "
                       "address; the oldest is closed")
        elif len(self._peers) >= most.pending:
            self._drop(next(iter(self._peers.values())), f"more than {most.pending} unproved "
                       "connections at once; the oldest is closed")
        conn.setblocking(False)
        prepare(conn)
        peer = _Peer(conn, address, time.monotonic(), HeadSide(self._token))
        self._peers[conn] = peer
        self._per_address[address] += 1
        self._selector.register(conn, selectors.EVENT_READ, peer)

    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(clear.FRAME_MAX + 8)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(peer, "it closed the connection during the handshake" if peer.spoke
                       else "")
            return
        peer.spoke = True
        peer.received += data
        try:
            frame, used = clear.split(peer.received)
            if frame is None:
                return
            if used != len(peer.received):
                raise HandshakeError("it sent more than one frame before the head answered")
            peer.received.clear()
            self._step(peer, frame)
        except HandshakeError as exc:
            self._drop(peer, str(exc))
        except Exception as exc:  # whatever a stranger sends closes its connection only
            self._drop(peer, f"{type(exc).__name__}: {exc}")

    def _step(self, peer: _Peer, frame: wire.Frame) -> None:
        if frame.kind is not wire.Kind.AUTH:
            raise HandshakeError(f"a {frame.kind.name} frame where the handshake has AUTH")
        body = clear.body(frame)
        if not peer.challenged:
            try:
                challenge = peer.head.challenge(body)
            except HandshakeError as exc:
                if "rendezvous" not in body:
                    raise
                self._send(peer, wire.Kind.REFUSE, {"why": str(exc), "fix": VERSION_FIX})
                self._drop(peer, f"{exc}; {VERSION_FIX}", agent=True)
                return
            self._send(peer, wire.Kind.AUTH, challenge)
            peer.challenged = True
            return
        try:
            reply, channel = peer.head.verify(body)
        except AuthError:
            self._send(peer, wire.Kind.REFUSE, {
                "why": "this agent's proof does not match the head's token", "fix": TOKEN_FIX})
            self._drop(peer, "an agent whose proof does not match the head's token (another "
                       f"job's, or an old one); {TOKEN_FIX}", agent=True)
            return
        self._send(peer, wire.Kind.AUTH, reply)
        self._release(peer)
        peer.sock.setblocking(True)
        self._on_pass(peer.sock, peer.address, channel, peer.since)

    def _send(self, peer: _Peer, kind: wire.Kind, body: dict[str, Any]) -> None:
        """A small frame into an empty send buffer; a peer that leaves it unread is dropped."""
        data = wire.encode_json(kind, body)
        try:
            sent = peer.sock.send(data)
        except OSError:
            sent = 0
        if sent != len(data):
            raise HandshakeError("it does not read what the head sends")

    def _expire(self, now: float) -> None:
        limit = self.limits.preauth_s
        for peer in list(self._peers.values()):
            if now - peer.since < limit:
                return
            self._drop(peer, f"it did not prove the token within {limit:g}s of connecting"
                       if peer.spoke else f"it sent nothing for {limit:g}s")

    def _release(self, peer: _Peer) -> None:
        if self._peers.pop(peer.sock, None) is not None:
            self._per_address[peer.address] -= 1
            if not self._per_address[peer.address]:
                del self._per_address[peer.address]
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(peer.sock)

    def _drop(self, peer: _Peer, why: str, *, agent: bool = False) -> None:
        """Close an unproved connection; ``why`` "": a bare port check, nothing to report."""
        self._release(peer)
        with contextlib.suppress(OSError):
            peer.sock.close()
        if why:
            self._note(peer.address, why, agent)


def _address(addr: tuple[str, int] | tuple[str, int, int, int]) -> str:
    """The peer's address, an IPv4 one without its IPv6-mapped prefix."""
    host = str(addr[0])
    return host.removeprefix("::ffff:") if "." in host else host
