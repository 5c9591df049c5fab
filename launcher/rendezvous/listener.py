"""The head's rendezvous socket: accept agents, run each handshake in a thread of its own,
keep the admitted ones alive until the start (adapter).

Before the start every admitted agent waits in the lobby: the head sends it heartbeats (its
own silence limit would end it otherwise) and notices when it goes away (its place is free
again). A wrong token, or an agent of another dtrain version, ends the rendezvous with one
error on both sides and nothing started; a connection that is no dtrain agent at all (a port
scan, a TCP health check) is dropped without a word. After the start the socket stays open, so
a late agent hears why it is refused instead of retrying until its deadline; one that takes a
vacated seat (`vacate`, the restart hook) is handed over on `replacements`.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable

from launcher import wire
from launcher.errors import RendezvousError
from launcher.rendezvous.handshake import AuthError, HandshakeError, HeadSide
from launcher.rendezvous.options import RendezvousOptions
from launcher.rendezvous.roster import Arrival, Roster, Unusable, read_join
from launcher.rendezvous.stream import (
    JoinedPeer,
    RendezvousStream,
    SealedSocket,
    prepare,
    read_clear,
    send_clear,
)

HANDSHAKE_S = 10.0   # from accept to JOIN: a peer slower than this is not an agent
HANDSHAKES = 64      # handshakes at once; a connection beyond waits in the listen backlog
TOKEN_FIX = ("give every agent the head's token file (--token-file or DTRAIN_RDZV_TOKEN_FILE); "
             "nothing was started")


def _say(text: str) -> None:
    sys.stderr.write(f"dtrain: {text}\n")
    sys.stderr.flush()


class Listener:
    def __init__(self, opts: RendezvousOptions, token: bytes, roster: Roster,
                 say: Callable[[str], None] = _say) -> None:
        self.roster, self.say = roster, say
        self._token, self._timeout = token, opts.timeout
        self._lock = threading.Condition()
        self._lobby: dict[str, tuple[Arrival, RendezvousStream]] = {}  # by host, lower case
        self._failure: RendezvousError | None = None
        self._closed = False
        self._handshakes = threading.BoundedSemaphore(HANDSHAKES)
        #: (node rank, stream) of each agent that took a vacated seat after the start.
        self.replacements: queue.Queue[tuple[int, RendezvousStream]] = queue.Queue()
        self.sock = _listen(opts)
        self.shown = f"{opts.host or '*'}:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, name="rendezvous-accept", daemon=True).start()

    # -- the lobby (the head's main thread) ------------------------------------------------
    def wait(self, deadline: float, heartbeat: float) -> list[tuple[Arrival, RendezvousStream]]:
        """Every agent in its place once all N joined; RendezvousError at the deadline or on a
        wrong token."""
        last_beat = 0.0
        while True:
            with self._lock:
                if self._failure is not None:
                    raise self._failure
                if self.roster.complete:
                    order = self.roster.start()
                    return [self._lobby.pop(a.host.lower()) for a in order]
            now = time.monotonic()
            if now >= deadline:
                with self._lock:
                    missing = self.roster.missing(f"within {self._timeout:g}s")
                raise RendezvousError(
                    "the rendezvous did not complete", f"--nnodes {self.roster.nnodes}, "
                    f"port {self.shown}", missing,
                    "start `dtrain agent --rendezvous HEAD:PORT` on the missing nodes, or "
                    "lower --nnodes or raise --rendezvous-timeout; nothing was started")
            beat = now - last_beat >= heartbeat
            last_beat = now if beat else last_beat
            self._watch_lobby(beat)
            with self._lock:
                self._lock.wait(0.2)

    def _watch_lobby(self, beat: bool) -> None:
        with self._lock:
            waiting = list(self._lobby.values())
        for arrival, stream in waiting:
            try:
                if beat:
                    stream.write(wire.encode(wire.Kind.HEARTBEAT))
                here = stream.sealed.alive()
            except (OSError, wire.WireError):
                here = False
            if not here:
                with self._lock:
                    self.roster.leave(arrival.host)
                    self._lobby.pop(arrival.host.lower(), None)
                    count = len(self._lobby)
                stream.kill()
                self.say(f"agent {arrival.shown()} left before the start; {count} of "
                         f"{self.roster.nnodes} agents here")

    def vacate(self, node_rank: int) -> None:
        """The restart hook: free the seat of a node a restart round gave up on; the next
        agent that joins takes it and arrives on `replacements`."""
        with self._lock:
            self.roster.vacate(node_rank)

    def close(self, why: str) -> None:
        """No more agents; those still waiting for a start that will not come are told why."""
        with self._lock:
            self._closed = True
            waiting, self._lobby = list(self._lobby.values()), {}
        with contextlib.suppress(OSError):
            self.sock.close()
        for _, stream in waiting:
            with contextlib.suppress(OSError):
                stream.sealed.send_json(wire.Kind.REFUSE, {"why": why, "fix": ""})
            stream.kill()
        while not self.replacements.empty():
            self.replacements.get()[1].kill()

    # -- one connection (a thread each) ----------------------------------------------------
    def _accept(self) -> None:
        while True:
            self._handshakes.acquire()  # a flood of connections waits here, not in threads
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handshake, args=(conn, _address(addr)),
                             name="rendezvous-join", daemon=True).start()

    def _handshake(self, conn: socket.socket, address: str) -> None:
        try:
            self._join(conn, address)
        finally:
            self._handshakes.release()

    def _join(self, conn: socket.socket, address: str) -> None:
        t0 = time.monotonic()
        deadline = t0 + HANDSHAKE_S
        prepare(conn)
        head = HeadSide(self._token)
        try:
            hello = read_clear(conn, deadline)
            if hello.kind is not wire.Kind.AUTH:
                raise HandshakeError("not a rendezvous hello")
            try:
                send_clear(conn, wire.Kind.AUTH, head.answer(hello.json()))
            except HandshakeError as exc:
                if "rendezvous" in hello.json():  # a dtrain agent of another version
                    self._refuse_clear(conn, address, str(exc), "install the same dtrain "
                                       "version on every node")
                raise
            reply = read_clear(conn, deadline)
            if reply.kind is wire.Kind.REFUSE:
                self._fail(address, "the agent's token differs from the head's (it refused "
                           "the head's proof)")
                raise HandshakeError("refused by the agent")
            sealed = SealedSocket(conn, head.verify(reply.json()))
            join = sealed.frame(deadline)
            if join.kind is not wire.Kind.JOIN:
                raise HandshakeError(f"{join.kind.name} instead of JOIN")
            arrival = read_join(join.json(), address)
        except AuthError:
            self._refuse_clear(conn, address, "the agent's proof does not match the head's "
                               "token", TOKEN_FIX)
            return
        except Unusable as exc:
            self._refuse(sealed, address, exc.why, exc.fix, fatal=True)
            return
        except (HandshakeError, OSError, wire.WireError):
            with contextlib.suppress(OSError):
                conn.close()
            return
        stream = RendezvousStream(arrival.host, sealed,
                                  JoinedPeer(address, (time.monotonic() - t0) * 1000, conn))
        self._admit(arrival, stream)

    def _admit(self, arrival: Arrival, stream: RendezvousStream) -> None:
        with self._lock:
            admission = self.roster.admit(arrival) if not self._closed else None
            if admission is not None and admission.admitted:
                try:
                    stream.sealed.send_json(wire.Kind.ADMIT, {"nnodes": self.roster.nnodes})
                except OSError:
                    self.roster.leave(arrival.host)
                    return
                if admission.seat is None:
                    self._lobby[arrival.host.lower()] = (arrival, stream)
                    self._lock.notify_all()
                else:
                    self.replacements.put((admission.seat, stream))
                return
        why = admission.why if admission is not None else "the head is leaving"
        self._refuse(stream.sealed, arrival.shown(), why, "", fatal=False)

    def _refuse(self, sealed: SealedSocket, who: str, why: str, fix: str, *,
                fatal: bool) -> None:
        if fatal:
            self._fail(who, why, fix)
        else:
            self.say(f"refused the agent {who}: {why}")
        with contextlib.suppress(OSError):
            sealed.send_json(wire.Kind.REFUSE, {"why": why, "fix": fix})
            sealed.sock.close()

    def _refuse_clear(self, conn: socket.socket, address: str, why: str, fix: str) -> None:
        self._fail(address, why, fix)
        with contextlib.suppress(OSError):
            send_clear(conn, wire.Kind.REFUSE, {"why": why, "fix": fix})
            conn.close()

    def _fail(self, who: str, why: str, fix: str = TOKEN_FIX) -> None:
        """Before the start: the rendezvous ends with this error. After it: one line."""
        with self._lock:
            if self.roster.started or self._closed:
                self.say(f"refused the agent at {who}: {why}")
                return
            if self._failure is None:
                self._failure = RendezvousError("agent refused", f"agent at {who}", why, fix)
            self._lock.notify_all()


def _listen(opts: RendezvousOptions) -> socket.socket:
    """Every address (IPv6 and IPv4 where the host has both) unless --rendezvous-host."""
    try:
        if opts.host:
            return socket.create_server((opts.host, opts.port), backlog=128)
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", opts.port), family=socket.AF_INET6,
                                        dualstack_ipv6=True, backlog=128)
        return socket.create_server(("", opts.port), backlog=128)
    except OSError as exc:
        raise RendezvousError("cannot listen for agents",
                              f"--rendezvous-port {opts.port}",
                              exc.strerror or str(exc),
                              "choose a free port, or the address of one of this host's "
                              "interfaces for --rendezvous-host") from None


def _address(addr: tuple[str, int] | tuple[str, int, int, int]) -> str:
    """The peer's address, an IPv4 one without its IPv6-mapped prefix."""
    host = str(addr[0])
    return host.removeprefix("::ffff:") if "." in host else host
