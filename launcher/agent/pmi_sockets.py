"""The agent's PMI-1 sockets: the adapter around the pure `launcher.pmi.proxy.PmiProxy` core.

Two ways for a rank to reach its agent, both local to the host, so the head's key-value space
is never exposed on the network:

* ``fd`` (default): a socketpair per rank, the child end inherited as ``PMI_FD``;
* ``port``: a listener on 127.0.0.1 (``PMI_PORT``), each rank with a one-time ``PMI_ID``
  token; a forged or reused id is refused by the proxy core without harming the job.
  Any local user can connect, so a connection is a stranger's until it presents a valid id,
  within `UNAUTHENTICATED_S` of its accept whatever it sends; at most `MAX_UNAUTHENTICATED`
  are kept (a new one replaces the oldest: a rank sends its id at once, so only strangers grow
  old), running out of files makes room instead of failing, and the listener closes once
  every rank of the host has connected.

One selector thread owns the sockets and the proxy; messages from the head are handed to it
through a queue and a wake-up socket, so no lock is needed around the core.
"""

from __future__ import annotations

import itertools
import queue
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import workerenv
from launcher.pmi import actions as pmi_actions
from launcher.pmi import proxy as pmi_proxy
from launcher.pmi.stall import StallClock

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from typing import Any

#: A PMI_PORT connection that has not presented a valid PMI_ID this long after it was accepted
#: is dropped, however much it sent (slowloris).
UNAUTHENTICATED_S = 30.0
#: The most PMI_PORT connections kept without a valid PMI_ID; a new one replaces the oldest.
MAX_UNAUTHENTICATED = 32
#: How long the listener rests when an accept fails with nothing to make room (out of files).
ACCEPT_PAUSE_S = 0.5
#: A reply the rank's socket cannot take at once may wait this long for room.
REPLY_TIMEOUT_S = 10.0
#: One read of a rank's socket: PMI-1 lines are at most 1,024 bytes and MPICH waits for each
#: answer, so a read nearly always holds one line; more stays for the next (level-triggered).
RECV_BYTES = 16384
_EXITED = "_rank_exited"  # the agent's own note through the inbox, never from the head


class PmiSockets:
    def __init__(
        self,
        *,
        mode: str,
        ranks: Sequence[int],
        world_size: int,
        kvsname: str,
        process_mapping: str,
        send_head: Callable[[dict[str, Any]], object],  # what it returns is not used
        stall_after: float = 30.0,
    ) -> None:
        self.mode = mode
        self._stall = StallClock(stall_after)
        # How often the loop asks which ranks hold a barrier up: a tenth of the interval (a
        # report comes at most that late), not at every PMI line: per line it was half of a
        # simulated relay's work in a slow fence (bench.sim_scale's profile, 512 hosts).
        self._stall_every, self._stall_next = min(1.0, stall_after / 10), 0.0
        self._send_head = send_head
        self._sel = _Poller()
        self._conns: dict[int, socket.socket] = {}
        self._ids = itertools.count(1)
        self._inbox: queue.Queue[Mapping[str, Any]] = queue.Queue()
        self._child_end: dict[int, socket.socket] = {}
        self._env: dict[int, dict[str, str]] = {}
        tokens = self._listen(ranks) if mode == "port" else {}
        self.proxy = pmi_proxy.PmiProxy(
            ranks=ranks, world_size=world_size, kvsname=kvsname,
            process_mapping=process_mapping, id_tokens=tokens or None,
        )
        if mode == "fd":
            self._pair(ranks)
        # PMI_PORT connections without a valid PMI_ID yet -> when accepted (oldest first)
        self._strangers: dict[int, float] = {}
        self._connected: set[int] = set()  # ranks that presented their PMI_ID
        self._accept_again: float | None = None  # when the paused listener is watched again
        self._kvsname = kvsname
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, "wake")
        self._stopped = False
        threading.Thread(target=self._loop, name="pmi", daemon=True).start()

    def _listen(self, ranks: Sequence[int]) -> dict[str, int]:
        """Port mode: one loopback listener; each rank gets its address and a random PMI_ID
        token (returned: token -> rank), which it must present before it is served."""
        import secrets  # only here: it costs the agent's start-up in the default fd mode

        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(max(16, len(ranks)))
        self._listener.setblocking(False)
        self._sel.register(self._listener, "accept")
        port = self._listener.getsockname()[1]
        tokens: dict[str, int] = {}
        for rank in ranks:
            # MPICH reads PMI_ID with atoi and echoes it with %d: a positive int32.
            token = str(secrets.randbelow(2**31 - 2) + 1)
            while token in tokens:
                token = str(secrets.randbelow(2**31 - 2) + 1)
            tokens[token] = rank
            self._env[rank] = {workerenv.PMI_PORT: f"127.0.0.1:{port}", workerenv.PMI_ID: token}
        return tokens

    def _pair(self, ranks: Sequence[int]) -> None:
        """Fd mode: a socket pair per rank, opened on the proxy; the rank inherits its end."""
        for rank in ranks:
            ours, theirs = socket.socketpair()
            conn = next(self._ids)
            self._add(conn, ours)
            self._run(self.proxy.open(conn, rank))
            self._child_end[rank] = theirs
            self._env[rank] = {workerenv.PMI_FD: str(theirs.fileno())}

    def rank_env(self, rank: int) -> dict[str, str]:
        return dict(self._env.get(rank, {}))

    def rank_fds(self, rank: int) -> list[int]:
        end = self._child_end.get(rank)
        return [end.fileno()] if end is not None else []

    def started(self, rank: int) -> None:
        """The rank has its copy of the inherited socket; close ours so EOF means it is gone."""
        end = self._child_end.pop(rank, None)
        if end is not None:
            end.close()

    def from_head(self, msg: Mapping[str, Any]) -> None:
        self._inbox.put(msg)
        self._wake()

    def exited(self, rank: int) -> None:
        """The rank's process exited (handed to the selector thread, which owns the proxy)."""
        self.from_head({"op": _EXITED, "rank": rank})

    def close(self) -> None:
        self._stopped = True
        self._wake()

    def remove_shared_memory(self) -> None:
        """Delete the /dev/shm segments of this job's MPICH ranks; killed ranks leave them."""
        from launcher.agent.leftovers import remove_mpich_segments

        remove_mpich_segments(self._kvsname)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _add(self, conn: int, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._conns[conn] = sock
        self._sel.register(sock, conn)

    def _drop(self, conn: int) -> None:
        sock = self._conns.pop(conn, None)
        if sock is not None:
            self._sel.unregister(sock)
            sock.close()

    def _loop(self) -> None:
        while not self._stopped:
            self._drop_strangers(time.monotonic())
            self._report_stall()
            for what in self._sel.poll(1.0):
                if what.__class__ is int:  # a rank's connection: nearly every wake-up
                    self._read(what)
                elif what == "wake":
                    self._wake_r.recv(4096)
                    self._drain_inbox()
                else:
                    self._accept()
        for conn in list(self._conns):
            self._drop(conn)
        self._sel.close()

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            op = msg.get("op")
            if op == _EXITED:
                self.proxy.exited(int(msg["rank"]))
            elif op == "stall_query":  # the head's barrier waits for this host: who is missing?
                missing, gone = self.proxy.holding_up(host_waited=True)
                self._send_head({"op": "stall_state", "ranks": missing, "gone": gone})
            else:
                self._run(self.proxy.upstream(msg))

    def _report_stall(self) -> None:
        """Some local ranks are in a barrier (or MPI_Init) and others are not: every
        --pmi-stall seconds, tell the head which (launcher.pmi.stall)."""
        now = time.monotonic()
        if now < self._stall_next:
            return
        self._stall_next = now + self._stall_every
        missing, gone = self.proxy.holding_up()
        waited = self._stall.due(now, self.proxy.epoch if missing else None)
        if waited is not None:
            self._send_head({"op": "stall", "ranks": missing, "gone": gone,
                             "seconds": round(waited)})

    def _drop_strangers(self, now: float) -> None:
        """Drop connections that did not present a valid PMI_ID in time; watch a paused
        listener again."""
        for conn, since in list(self._strangers.items()):
            if now - since <= UNAUTHENTICATED_S:
                break  # oldest first: the rest are younger
            self._drop_stranger(conn)
        if self._accept_again is not None and now >= self._accept_again:
            self._accept_again = None
            self._sel.register(self._listener, "accept")

    def _drop_stranger(self, conn: int) -> None:
        self._strangers.pop(conn, None)
        self._run(self.proxy.closed(conn))
        self._drop(conn)

    def _accept(self) -> None:
        """One connection per round of the loop, so a rank's first line is read before a
        flood of new connections can push it out of `MAX_UNAUTHENTICATED`."""
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # out of files or memory: room from a stranger, else a short rest
            if self._strangers:
                self._drop_stranger(next(iter(self._strangers)))
            else:
                self._sel.unregister(self._listener)
                self._accept_again = time.monotonic() + ACCEPT_PAUSE_S
            return
        if len(self._strangers) >= MAX_UNAUTHENTICATED:
            self._drop_stranger(next(iter(self._strangers)))
        conn = next(self._ids)
        self._add(conn, sock)
        self._strangers[conn] = time.monotonic()
        self._run(self.proxy.open(conn, None))

    def _authenticated(self, conn: int, rank: int) -> None:
        """``conn`` presented ``rank``'s PMI_ID; once all have, nobody else may connect."""
        del self._strangers[conn]
        self._connected.add(rank)
        if len(self._connected) < len(self._env):
            return
        if self._accept_again is None:
            self._sel.unregister(self._listener)
        self._accept_again = None
        self._listener.close()
        for stranger in list(self._strangers):
            self._drop_stranger(stranger)

    def _read(self, conn: int) -> None:
        sock = self._conns.get(conn)
        if sock is None:
            return
        try:
            data = sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            # A wire-up's get, answered without the actions `_run` walks: on cores its ranks
            # share, each get's trip through the generic path cost the agent ~29 us of CPU
            # (64 namespace hosts, `bench.hosts_scale`), ~5 us in-process.
            reply = self.proxy.fast_get(conn, data)
            if reply is not None:
                self._reply(conn, sock, reply)
                return
            actions = self.proxy.feed(conn, data)
            rank = self.proxy.rank_of(conn) if conn in self._strangers else None
            if rank is not None:
                self._authenticated(conn, rank)  # before its reply: the port is closed by then
            self._run(actions)
        else:
            self._strangers.pop(conn, None)
            self._run(self.proxy.closed(conn))
            self._drop(conn)

    def _run(self, actions: Sequence[pmi_actions.Action]) -> None:
        for action in actions:
            if isinstance(action, pmi_actions.Reply):
                sock = self._conns.get(action.conn)
                if sock is not None:
                    self._reply(action.conn, sock, action.data)
            elif isinstance(action, pmi_actions.Close):
                self._strangers.pop(action.conn, None)
                self._drop(action.conn)
            elif isinstance(action, pmi_actions.Send):
                self._send_head(dict(action.msg))
            elif isinstance(action, pmi_actions.RankFailed):
                self._send_head({"op": "rank_failed", "rank": action.rank, "reason": action.reason})
            # pmi_actions.Abort needs nothing here: the proxy also Sends the abort to the head.

    def _reply(self, conn: int, sock: socket.socket, data: bytes) -> None:
        # Replies are short and the rank is waiting for them: one non-blocking send nearly
        # always takes it all (one system call, not four per reply); else, a rank that
        # stopped reading has failed anyway, so a bounded blocking send is enough.
        try:
            try:
                sent = sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            if sent < len(data):
                sock.settimeout(REPLY_TIMEOUT_S)
                sock.sendall(data[sent:])
                sock.setblocking(False)
        except OSError:
            self._run(self.proxy.closed(conn))
            self._drop(conn)


class _Poller:
    """The sockets the PMI thread reads, each with what it is (a connection's number, "wake",
    "accept"): epoll itself (the agent's hosts are Linux), not `selectors`, whose Python layer
    around it cost ~3.5 us of the ~5 us in-process of a get's whole trip through the agent,
    and 640 gets a rank come one after the other at 64 ranks."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._what: dict[int, int | str] = {}

    def register(self, sock: socket.socket, what: int | str) -> None:
        self._epoll.register(sock.fileno(), select.EPOLLIN)
        self._what[sock.fileno()] = what

    def unregister(self, sock: socket.socket) -> None:
        """Before the socket closes (its descriptor is still its own)."""
        fd = sock.fileno()
        self._epoll.unregister(fd)
        del self._what[fd]

    def poll(self, timeout: float) -> list[int | str]:
        """What is readable (or hung up: its read then ends it), within ``timeout`` seconds."""
        what = self._what
        try:
            return [what[fd] for fd, _ in self._epoll.poll(timeout) if fd in what]
        except InterruptedError:
            return []

    def close(self) -> None:
        self._epoll.close()
