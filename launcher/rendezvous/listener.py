"""The head's rendezvous socket: the gate in front (`gate`), then each JOIN in a thread of its
own, the lobby of admitted agents until the start, late agents after it (adapter).

Only an agent that proved the token can change the rendezvous. A connection that did not (a
port scan, a health check, an idle or malformed peer, an agent with another job's token or of
another version) is closed at the gate and counted (`Strangers`: one line per address,
rate-limited); the rendezvous goes on, and its timeout names the addresses where agents failed
the token. An agent that proved the token but cannot join any job of this head (another
protocol, a bad host name) ends the rendezvous with one error on both sides, nothing started.

Before the start every admitted agent waits in the lobby: the head sends it heartbeats (its
own silence limit would end it otherwise) and notices when it goes away (its place is free
again). After the start the socket stays open, so a late agent hears why it is refused instead
of retrying until its deadline; one that takes a vacated seat (`vacate`, the restart hook) is
handed over on `replacements`.
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
from launcher.rendezvous import clear
from launcher.rendezvous.channel import Channel
from launcher.rendezvous.gate import Gate, Limits
from launcher.rendezvous.handshake import HandshakeError
from launcher.rendezvous.options import RendezvousOptions
from launcher.rendezvous.roster import Arrival, Roster, Unusable, read_join
from launcher.rendezvous.strangers import Strangers
from launcher.rendezvous.stream import JoinedPeer, RendezvousStream, SealedSocket

JOIN_S = 10.0   # from accept to JOIN, for an agent that proved the token


def _say(text: str) -> None:
    sys.stderr.write(f"dtrain: {text}\n")
    sys.stderr.flush()


class Listener:
    def __init__(self, opts: RendezvousOptions, token: bytes, roster: Roster,
                 say: Callable[[str], None] = _say, limits: Limits = Limits()) -> None:
        self.roster, self.say = roster, say
        self._token, self._timeout = token, opts.timeout
        self._lock = threading.Condition()
        self._lobby: dict[str, tuple[Arrival, RendezvousStream]] = {}  # by host, lower case
        self._failure: RendezvousError | None = None
        self._closed = False
        self._strangers = Strangers()
        #: (node rank, stream) of each agent that took a vacated seat after the start.
        self.replacements: queue.Queue[tuple[int, RendezvousStream]] = queue.Queue()
        self.sock = _listen(opts)
        self.port = self.sock.getsockname()[1]
        self.shown = f"{opts.host or '*'}:{self.port}"
        self.gate = Gate(self.sock, token, self._passed, self._note, limits)

    # -- the lobby (the head's main thread) ------------------------------------------------
    def wait(self, deadline: float, heartbeat: float) -> list[tuple[Arrival, RendezvousStream]]:
        """Every agent in its place once all N joined; RendezvousError at the deadline, or when
        an agent that proved the token cannot join any job of this head."""
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
                    failed = self._strangers.agents()
                if failed:
                    missing += f"; agents failed the token (or version) from {failed}"
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
        self.gate.close()
        for _, stream in waiting:
            with contextlib.suppress(OSError):
                stream.sealed.send_json(wire.Kind.REFUSE, {"why": why, "fix": ""})
            stream.kill()
        while not self.replacements.empty():
            self.replacements.get()[1].kill()

    # -- one proved connection (a thread each) --------------------------------------------
    def _note(self, address: str, why: str, agent: bool) -> None:
        """A connection dropped before it proved anything: counted, and a line now and then."""
        with self._lock:
            line = self._strangers.note(address, clear.shown(why), time.monotonic(), agent=agent)
        if line:
            self.say(line)

    def _passed(self, conn: socket.socket, address: str, channel: Channel, since: float) -> None:
        threading.Thread(target=self._join, args=(conn, address, channel, since),
                         name="rendezvous-join", daemon=True).start()

    def _join(self, conn: socket.socket, address: str, channel: Channel, since: float) -> None:
        sealed = SealedSocket(conn, channel)
        try:
            join = sealed.frame(since + JOIN_S)
            if join.kind is not wire.Kind.JOIN:
                raise HandshakeError(f"{join.kind.name} instead of JOIN")
            arrival = read_join(clear.body(join), address)
        except Unusable as exc:
            self._refuse(sealed, address, exc.why, exc.fix, fatal=True)
            return
        except BaseException as exc:  # a broken stream, or anything else: this agent only
            with contextlib.suppress(OSError):
                conn.close()
            if isinstance(exc, Exception):
                self._note(address, f"an agent that proved the token broke off before its "
                           f"JOIN: {exc}", False)
                return
            raise
        stream = RendezvousStream(arrival.host, sealed,
                                  JoinedPeer(address, (time.monotonic() - since) * 1000, conn))
        self._admit(arrival, stream)

    def _admit(self, arrival: Arrival, stream: RendezvousStream) -> None:
        with self._lock:
            admission = self.roster.admit(arrival) if not self._closed else None
            if admission is not None and admission.admitted:
                try:
                    stream.sealed.send_json(wire.Kind.ADMIT, {"nnodes": self.roster.nnodes})
                except OSError:
                    self.roster.leave(arrival.host)
                    stream.kill()
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
            self._fail(who, clear.shown(why), fix)
        else:
            self.say(f"refused the agent {who}: {why}")
        with contextlib.suppress(OSError):
            sealed.send_json(wire.Kind.REFUSE, {"why": why, "fix": fix})
        with contextlib.suppress(OSError):
            sealed.sock.close()

    def _fail(self, who: str, why: str, fix: str) -> None:
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
            return socket.create_server((opts.host, opts.port), backlog=1024)
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", opts.port), family=socket.AF_INET6,
                                        dualstack_ipv6=True, backlog=1024)
        return socket.create_server(("", opts.port), backlog=1024)
    except OSError as exc:
        raise RendezvousError("cannot listen for agents",
                              f"--rendezvous-port {opts.port}",
                              exc.strerror or str(exc),
                              "choose a free port, or the address of one of this host's "
                              "interfaces for --rendezvous-host") from None
