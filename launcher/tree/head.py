"""The head's side of a fan-out: K real streams, one `RelayedStream` per host.

The head starts the hosts the tree's shape gives it (`launcher.tree.shape`) over the ssh
launcher's transport, sends each its SUBTREE first (`launcher.tree.relay`), and hands the rest
of the launch one stream per host, in host order, as a flat launch does: the supervisor, the
start-up and the restarts see no difference. A `RelayLine` reads one real stream and sorts what
arrives into the streams of the hosts below it (ROUTED by index; the relay's own frames as
they are; GONE ends one); what the head writes to a host below goes out ROUTED.

When a relay's stream ends, every host below it ends with it, each naming the relay and the
whole subtree (the job's failure names them; nothing of theirs is left: their agents lose
their own streams with the relay and stop their ranks).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from launcher import wire
from launcher.errors import ConnectError, DtrainError
from launcher.hosts.selection import HostSlots
from launcher.transport.options import SSHOptions
from launcher.transport.stream import AgentConnection, AgentStream
from launcher.transport.table import Transport
from launcher.tree import hops
from launcher.tree.shape import HEAD, Tree


def start_tree(selected: Sequence[HostSlots], tree: Tree, *, python: str, ssh: SSHOptions,
               transport: Transport | None = None) -> list[AgentStream | ConnectError]:
    """An agent stream, or why there is none, per host in order: the head connects to the
    hosts it starts over ``transport`` (a dispatch row with relays; default ssh); the
    others' streams run through their relays, which reach their hosts by the hops the row's
    ``relays`` function describes."""
    from launcher.transport import table

    transport = transport or table.get(table.DEFAULT_LAUNCHER)
    entries = [h.entry for h in selected]
    top = list(tree.children(HEAD))
    below = [i for i in range(tree.hosts) if i not in set(top)]
    described = dict(zip(below, transport.load_relays()([entries[i] for i in below], ssh),
                         strict=True))
    started = transport.load()([selected[i] for i in top], python=python, ssh=ssh)
    out: dict[int, AgentStream | ConnectError] = {}
    for root, stream in zip(top, started, strict=True):
        subtree = tree.subtree(root)
        if isinstance(stream, ConnectError):
            out[root] = stream
            out.update((i, ConnectError("not started", f"host {entries[i].name}",
                                        f"its relay {entries[root].name} could not be reached",
                                        "fix that host first")) for i in subtree if i != root)
            continue
        line = RelayLine(stream, root, {i: entries[i].name for i in subtree},
                         {i: str(described[i]["hostname"]) for i in subtree if i != root})
        out.update(line.streams)
        body = subtree_body(tree, root, [e.name for e in entries], described, python=python,
                            ssh=hops.forwarded_options(ssh))
        line.write(root, wire.encode_json(wire.Kind.SUBTREE, body))
        line.start()
    return [out[i] for i in range(tree.hosts)]


def open_tree(selected: Sequence[HostSlots], tree: Tree, *, python: str, ssh: SSHOptions,
              transport: Transport | None = None) -> list[AgentStream]:
    """`start_tree`, or the first ConnectError with nothing left running (`open_streams`)."""
    from launcher.transport.connect import close_streams, validate_remote_python

    results = start_tree(selected, tree, python=validate_remote_python(python), ssh=ssh,
                         transport=transport)
    streams = [r for r in results if not isinstance(r, ConnectError)]
    errors = [r for r in results if isinstance(r, ConnectError)]
    if errors:
        close_streams(streams)
        raise errors[0]
    return streams


def subtree_body(tree: Tree, root: int, names: Sequence[str], described: dict[int, Any], *,
                 python: str, ssh: dict[str, Any]) -> dict[str, Any]:
    """The SUBTREE frame's body for the relay ``root`` (the simulator builds its own with
    empty hops and gives the relays a connector: `launcher.tree.relay.Relay`)."""

    def node(host: int) -> dict[str, Any]:
        return {"index": host, "name": names[host], "hop": described.get(host, {}),
                "children": [node(c) for c in tree.children(host)]}

    return {"index": root, "python": python, "ssh": ssh,
            "children": [node(c) for c in tree.children(root)]}


class RelayLine:
    """One real stream to a host the head started, and the streams of its subtree."""

    def __init__(self, real: AgentStream, own: int, names: dict[int, str],
                 addresses: dict[int, str]) -> None:
        self.real, self.own = real, own
        self._lock = threading.Lock()
        self.delivering = False  # the reading thread is inside a host's handling (`held`)
        self._open = set(names)
        self.streams = {i: RelayedStream(self, i, name, addresses.get(i))
                        for i, name in names.items()}

    def start(self) -> None:
        threading.Thread(target=self._read, name=f"relay-line-{self.own}", daemon=True).start()

    def write(self, index: int, data: bytes) -> None:
        with self._lock:
            self.real.write(data if index == self.own else wire.encode_routed(index, data))

    def closed(self, index: int) -> None:
        """``index``'s stream was closed by the head; the last one closes the real stream."""
        with self._lock:
            self._open.discard(index)
            last = not self._open
        if last:
            self.real.close()

    def _read(self) -> None:
        decoder = wire.Decoder()
        why = "the relay's stream closed"
        try:
            while data := self.real.read(65536):
                self.delivering = True
                for frame in decoder.feed(data):
                    if frame.kind is wire.Kind.ROUTED:
                        index, inner = wire.decode_routed(frame)
                        if index in self.streams:
                            self.streams[index].feed(inner)
                    elif frame.kind is wire.Kind.GONE:
                        body = frame.json()
                        stream = self.streams.get(int(body.get("host", -1)))
                        if stream is not None:
                            stream.end(str(body.get("why")), body.get("connect"))
                    else:
                        self.streams[self.own].feed(wire.encode(frame.kind, frame.payload))
                self.delivering = False
        except (OSError, EOFError, ValueError) as exc:
            why = f"the relay's stream broke: {exc}"
        self.delivering = False
        relay = self.streams[self.own].host
        others = [s for i, s in sorted(self.streams.items()) if i != self.own]
        names = ", ".join(s.host for s in others)
        for stream in others:
            stream.end(f"lost with its relay {relay} (its subtree: {names}): {why}", None)
        self.streams[self.own].end(f"{why}; its subtree is lost with it: {names}", None)


class RelayedConnection:
    """The `connection` of a relayed host: its address as the head's ssh config gives it."""

    latency_ms = 0.0

    def __init__(self, stream: RelayedStream, address: str) -> None:
        self._stream, self._address = stream, address

    def peer_address(self) -> str:
        return self._address

    def close(self) -> None:
        self._stream.close()


class RelayedStream:
    """`AgentStream` of one host of a relay line (the relay's own included)."""

    is_local = False

    def __init__(self, line: RelayLine, index: int, host: str, address: str | None) -> None:
        self.line, self.tree_index, self.host = line, index, host
        self._own = index == line.own
        self._incoming: queue.Queue[bytes] = queue.Queue()  # until someone `listen`s
        self._deliver: Callable[[bytes], None] | None = None
        self._on_end: Callable[[], None] | None = None
        self._gate = threading.Lock()  # the line's thread feeds; `listen` takes over the queue
        self._ended = threading.Event()
        self._closed = False
        self._why = ""
        self._connect: dict[str, Any] | None = None
        self._connection = None if address is None else RelayedConnection(self, address)

    @property
    def connection(self) -> AgentConnection | None:
        return self.line.real.connection if self._own else self._connection

    @property
    def relays(self) -> bool:
        """The relay's own stream of a line that carries other hosts: closing it early would
        end theirs (`launcher.head.supervisor` lets a done host leave only when it is not)."""
        return self._own and len(self.line.streams) > 1

    @property
    def held(self) -> bool:
        """The line's thread is busy delivering (maybe blocked on the head's full output
        queue): no host of the line is read meanwhile, so none of them is silent."""
        return self.line.delivering

    def listen(self, deliver: Callable[[bytes], None], on_end: Callable[[], None]) -> None:
        """From now on the line's thread hands this host's bytes to ``deliver`` and its end to
        ``on_end`` (`launcher.head.agent_link.AgentLink`: no reader thread per host); what
        arrived before goes first."""
        with self._gate:
            while not self._incoming.empty():
                data = self._incoming.get()
                if data:
                    deliver(data)
            self._deliver, self._on_end = deliver, on_end
            if self._ended.is_set():
                on_end()

    def feed(self, data: bytes) -> None:
        with self._gate:
            if self._ended.is_set():
                return
            if self._deliver is None:
                self._incoming.put(data)
                return
        self._deliver(data)  # only the line's thread feeds: in order without the gate

    def end(self, why: str, connect: dict[str, Any] | None) -> None:
        with self._gate:
            if self._ended.is_set():
                return
            self._why, self._connect = why, connect
            self._ended.set()
            on_end = self._on_end
            if on_end is None:
                self._incoming.put(b"")
        if on_end is not None:
            on_end()

    def write(self, data: bytes) -> None:
        if self._closed or self._ended.is_set():
            raise OSError(f"the stream to the agent on {self.host} is closed")
        self.line.write(self.tree_index, data)

    def read(self, max_bytes: int = 65536) -> bytes:
        return self._incoming.get()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.line.closed(self.tree_index)

    def abort(self) -> None:
        self.close()
        self.end("given up", None)

    def wait(self, timeout: float | None = None) -> int | None:
        if self._own and not self.line._open:
            return self.line.real.wait(timeout)
        return 0 if self._ended.wait(timeout) else None

    def kill(self) -> None:
        if self._own and not self.line._open:
            self.line.real.kill()
        self.abort()

    def stderr_text(self) -> str:
        """What the relay's agent wrote; for a host below it, why its stream ended."""
        if not self._own:
            return self._why
        return self.line.real.stderr_text() + (f"\n{self._why}" if self._why else "")

    def transport_error(self) -> DtrainError | None:
        if self._own:
            return self.line.real.transport_error()
        if self._connect is None:
            return None
        return ConnectError(str(self._connect.get("what") or f"cannot connect to {self.host}"),
                            str(self._connect.get("where") or f"host {self.host}"),
                            str(self._connect.get("why") or self._why),
                            str(self._connect.get("fix") or ""))
