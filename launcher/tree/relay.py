"""The relay: an agent that also starts the agents of its subtree and carries their streams.

The head's first frame to a relay is SUBTREE: the relay's own index, the hosts it starts (each
with its hop, `launcher.tree.hops`, and its own subtree), the agent's Python. The relay
connects to its children in parallel, from a thread (its own agent answers the head meanwhile),
sends each child relay its SUBTREE, then what the head already sent for it. From then on:

* down: a ROUTED frame for a host below goes to the child on the way, unwrapped for the child
  itself; a SPEC passing by tells the fence (`launcher.tree.fence`) which hosts take part;
* up: what a child sends goes up (`launcher.tree.upstream` reads it), but for its PMI
  ``barrier_in``, which goes into the fence, and a ``get`` for a card the relay passed down,
  answered here;
* a child whose stream ends is GONE, with every host below it; what goes down is queued (`_send`).

The relay outlives its own agent's job while any child is connected and ends with the stream
from its parent: closing the children's streams, whose agents then stop their ranks.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from launcher import wire
from launcher.tree.fence import SubtreeFence, flatten

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Protocol

    from launcher.transport.stream import AgentStream
    from launcher.tree import upstream

    class Upward(upstream.Upward, Protocol):
        """The link to the relay's parent (the agent's `HeadLink`)."""

        def send(self, data: bytes) -> bool: ...
        def send_json(self, kind: wire.Kind, obj: dict[str, Any] | None = None) -> bool: ...

    class Writer(Protocol):
        """A child's writer thread (`launcher.agent.writer.FrameWriter`)."""

        def send(self, frame: bytes) -> bool: ...
        def flush(self, timeout: float) -> bool: ...

_CARDS_OPEN = b'{"op":"cards"'  # how a fetch's answer begins
_CARDS = (_CARDS_OPEN, wire.COMPRESSED)  # ... or any compressed PMI message
PENDING_BEAT_S = 1.0  # heartbeats for hosts still being connected (the default's fifth)
CLOSE_FLUSH_S = 2.0  # as the agent's own last frames (`launcher.agent.serve`)
VOUCH_S = 60.0  # how long, as the agent waits for its head's SPEC (agent.main.HELLO_SILENCE_S)


class Relay:
    def __init__(self, body: dict[str, Any], up: Upward,
                 own_pmi: Callable[[dict[str, Any]], None],
                 connect: Callable[[dict[str, Any]], AgentStream] | None = None, *,
                 writer: Callable[[Any], Writer], keys_folder: Callable[[], str] | None = None,
                 ) -> None:
        """``up``: the agent's link to its parent; ``own_pmi``: a PMI message for this host's
        own ranks (`PmiSockets.from_head`); ``connect``: a child's stream from its SUBTREE node
        (index, name, hop), or a ConnectError (default: its agent over SSH as the hop says, its
        known_hosts lines in a folder from ``keys_folder``, the agent's, which the next agent
        removes if this one is SIGKILLed: needed when ``connect`` is None); ``writer``: makes a
        child's writer thread from its sink (`launcher.agent.writer.FrameWriter`: no agent
        import)."""
        if connect is None and keys_folder is None:
            raise ValueError("a relay that starts its children over SSH needs a folder for "
                             "their known_hosts lines")
        self._connect, self._keys_folder = connect, keys_folder  # None: over SSH
        self._writer, self.own = writer, int(body["index"])
        self.up, self._own_pmi = up, own_pmi
        self._python = str(body["python"])
        self._ssh = dict(body.get("ssh") or {})
        self._children = {int(c["index"]): c for c in body["children"]}
        route = {self.own: self.own}
        self._below: dict[int, list[dict[str, Any]]] = {}  # child -> every node below it
        for index, child in self._children.items():
            nodes = flatten(child)
            self._below[index] = nodes[1:]
            route.update((int(n["index"]), index) for n in nodes)
        self.fence = SubtreeFence(self.own, route)
        self._streams: dict[int, AgentStream | None] = dict.fromkeys(self._children)
        self._writers: dict[int, Writer] = {}  # per connected child: sends never block
        self._waiting: dict[int, list[bytes]] = {c: [] for c in self._children}
        self._alive = set(self._children)
        self.spawns = False  # a child's stream ran in a process of this agent's (`ssh`)
        self._lingering: queue.Queue[Any] | None = None  # woken when the last child is lost
        self._lock = threading.Lock()
        self._keys: Any = None
        self._upstream: Any = None  # reads the children's streams, made in `start`

    def transport_pids(self) -> frozenset[int]:
        """The processes that carry the children's streams (`ssh`'s; none over paramiko): the
        agent keeps them when it kills what its own ranks left (the subtree's links)."""
        with self._lock:
            streams = list(self._streams.values())
        return frozenset(pid for stream in streams
                         if isinstance(pid := getattr(stream, "pid", None), int))

    def start(self) -> None:
        """Connect the children from a thread, importing what that needs here first: a module
        imported by two threads at once can be seen half-made (`typing`, as paramiko loads it)."""
        if self._connect is None:
            from launcher.tree.hops import client_of

            if client_of(self._children) == "openssh":
                self.spawns = True  # from its first `ssh` on, not once a stream is attached
                import launcher.transport.openssh.session
            else:
                from launcher.transport.connect import import_paramiko

                import_paramiko(allow_config_exec=False)
                import launcher.transport.ssh
            import launcher.transport.local
            import launcher.tree.hops  # noqa: F401
        from launcher.tree.upstream import Upstream

        self._upstream = Upstream(self.up, self._pmi_up, self._child_ended)
        threading.Thread(target=self._connect_all, name="relay-connect", daemon=True).start()
        threading.Thread(target=self._beat_pending, name="relay-beat", daemon=True).start()

    def _beat_pending(self) -> None:
        """Until a child's agent first speaks, a heartbeat for it and every host below it: a
        deep host's start-up (the hops above it, its login) is not its silence. For VOUCH_S at
        most: an agent that never speaks is then silent as a flat launch's would be."""
        beat = wire.encode(wire.Kind.HEARTBEAT)
        until = time.monotonic() + VOUCH_S
        while time.monotonic() < until:
            time.sleep(PENDING_BEAT_S)
            with self._lock:
                pending = [c for c in self._alive if c not in self._upstream.spoke]
            if not pending:
                return
            for child in pending:
                for host in [child, *(int(n["index"]) for n in self._below[child])]:
                    self.up.send(wire.encode_routed(host, beat))

    # -- down ----------------------------------------------------------------------------------
    def down(self, frame: wire.Frame) -> None:
        """A ROUTED frame from the parent, for a host below."""
        target, inner = wire.decode_routed(frame)
        hop = self.fence.route.get(target)
        if hop is None or hop == self.own:
            return
        if len(inner) > 4 and inner[4] == wire.Kind.SPEC:
            with contextlib.suppress(wire.WireError):
                for spec in wire.Decoder().feed(inner):
                    if spec.kind is wire.Kind.SPEC:
                        with self._lock:
                            self.fence.spec(target, spec.json())
        self._send(hop, inner if hop == target else wire.encode(frame.kind, frame.payload))
        if len(inner) > 5 and inner[4] == wire.Kind.PMI and inner[5:18].startswith(_CARDS):
            self._cards_down(target, inner)

    def _cards_down(self, target: int, inner: bytes) -> None:
        """Every card passing down (a fetch's answer): the fetches that waited for it answered
        with the frame's own bytes (`wire.split`: not a copy made by decoding and encoding it
        again, 1.3 MB at 1,024 hosts), then its cards decoded and kept for the gets that
        follow."""
        for frame in wire.split(inner):
            payload = memoryview(frame)[5:]  # read, not kept: not a copy of the cards
            if frame[4] != wire.Kind.PMI or not wire.opens(payload, _CARDS_OPEN):
                continue
            with self._lock:
                waiting = self.fence.cards_passing(target, frame)
            for host in waiting:
                self._send(host, frame)
            with contextlib.suppress(wire.WireError):
                kv = wire.decode_json(wire.Kind.PMI, payload).get("kv")
                with self._lock:
                    self.fence.cards(target, kv if isinstance(kv, dict) else {})

    def own_get(self, msg: dict[str, Any]) -> bool:
        """The own agent's ``get``: answered here (True) when the relay holds the card."""
        with self._lock:
            value = self.fence.get(self.own, msg.get("key"))
        if value:
            self._own_pmi({"op": "get_result", "req": msg.get("req"), "found": True,
                           "value": value})
        return bool(value)

    def own_spec(self, body: dict[str, Any]) -> None:
        with self._lock:
            self.fence.spec(self.own, body)

    def own_barrier(self, msg: dict[str, Any]) -> None:  # into the fence, not to the parent
        self._enter(self.own, msg)

    def fence_out(self, msg: dict[str, Any]) -> None:
        """The parent's ``barrier_out`` for the hosts this relay covered."""
        with self._lock:
            pairs = self.fence.out(msg)
        cards: bytes | None = None  # every relay below gets the same cards: encoded once
        leaf: dict[str, bytes] = {}  # and every host its same push and release, by op
        for hop, body in pairs:
            if hop == self.own:
                self._own_pmi(body)
            elif "hosts" in body:
                cards = cards if cards is not None else wire.encode_value(body["kv"])
                self._send(hop, wire.encode_json_shared(wire.Kind.PMI, body, "kv", cards))
            else:
                if body["op"] not in leaf:
                    leaf[body["op"]] = wire.encode_json(wire.Kind.PMI, body)
                self._send(hop, leaf[body["op"]])

    def linger(self, events: queue.Queue[Any], ended: Callable[[Any], bool]) -> None:
        """After the own agent is done: carry the children's streams until they end (the
        last one's loss wakes it: `_lost`), or the parent's does (an ``ended`` event)."""
        self._lingering = events
        while self._alive:
            event = events.get()
            if ended(event):
                return
            if isinstance(event, wire.Frame) and event.kind is wire.Kind.ROUTED:
                self.down(event)

    def close(self) -> None:
        """Close every child's stream: their agents stop their ranks and leave. What is still
        queued for them (a BYE the head sent last) goes first, for `CLOSE_FLUSH_S` at most."""
        with self._lock:
            streams, self._streams = dict(self._streams), {}
            writers, self._writers = list(self._writers.values()), {}
            self._alive.clear()
        deadline = time.monotonic() + CLOSE_FLUSH_S
        for writer in writers:
            writer.flush(max(0.0, deadline - time.monotonic()))
        from launcher.transport.connect import close_streams

        close_streams([s for s in streams.values() if s is not None])  # together, not in turn
        if self._keys is not None:
            self._keys.remove()

    # -- connecting ----------------------------------------------------------------------------
    def _connect_all(self) -> None:
        connect = self._connect
        if connect is None:  # each child's agent over SSH, as its hop says: its keys first
            from launcher.tree.hops import RelayKeys

            assert self._keys_folder is not None  # required with no `connect` (`__init__`)
            try:
                self._keys = RelayKeys(self._keys_folder())
                connect = self._keys.connector(self._children, self._python, self._ssh)
            except Exception as exc:  # noqa: BLE001 (every child is lost, and says why)
                for index in self._children:
                    self._lost(index, f"the relay could not start it: {exc}", connect=True)
                return
        self._start_children(connect)

    def _start_children(self, connect: Callable[[dict[str, Any]], AgentStream]) -> None:
        from launcher.errors import ConnectError

        def one(index: int) -> None:
            try:
                stream = connect(self._children[index])
            except ConnectError as exc:
                self._lost(index, str(exc), connect=True, error=exc)
                return
            self._attach(index, stream)

        workers = max(1, min(int(self._ssh.get("max_parallel", 32)), len(self._children)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="relay") as pool:
            list(pool.map(one, self._children))

    def _attach(self, index: int, stream: AgentStream) -> None:
        child = self._children[index]
        first = [wire.encode_json(wire.Kind.SUBTREE, {
            "index": index, "python": self._python, "ssh": self._ssh,
            "children": child["children"]})] if child["children"] else []
        with self._lock:
            if index not in self._alive:
                stream.close()
                return
            pending, self._waiting[index] = self._waiting[index], []
            self._streams[index] = stream
            self.spawns = self.spawns or isinstance(getattr(stream, "pid", None), int)
            self._writers[index] = self._writer(_StreamSink(stream))
            if first or pending:
                self._writers[index].send(b"".join([*first, *pending]))
        self._upstream.read(index, stream)

    # -- up ------------------------------------------------------------------------------------
    def _child_ended(self, index: int, stream: AgentStream, error: BaseException | None) -> None:
        reason = f"its agent's stream {'closed' if error is None else f'broke: {error}'}"
        stderr = stream.stderr_text().strip().splitlines()[-3:]
        self._lost(index, reason + (f" (agent stderr: {' | '.join(stderr)})" if stderr else ""))

    def _pmi_up(self, index: int, payload: memoryview) -> bool:
        """A child's PMI message handled here (True), or to go up as it is (False)."""
        msg = wire.decode_json(wire.Kind.PMI, payload)
        if msg.get("op") == "barrier_in":
            self._enter(index, msg)
            return True
        if msg.get("op") == "get":
            with self._lock:
                value = self.fence.get(index, msg.get("key"))
            if value:
                self._send(index, wire.encode_json(wire.Kind.PMI, {
                    "op": "get_result", "req": msg.get("req"), "found": True, "value": value}))
                return True
        if msg.get("op") == "fetch":  # every card: answered here, or once per relay up
            with self._lock:
                answer = self.fence.fetch(index)
                waits = answer is None and self.fence.fetch_waits(index)
            if answer is not None:
                self._send(index, answer)
            return answer is not None or waits
        return False

    def _enter(self, host: int, msg: dict[str, Any]) -> None:
        with self._lock:
            aggregate = self.fence.enter(host, msg)
        if aggregate is not None:
            self.up.send_json(wire.Kind.PMI, aggregate)

    def _send(self, hop: int, data: bytes) -> None:
        """Queue ``data`` for child ``hop``: never blocks (a child slow to read must not stall
        the relay's agent, which forwards every frame down, nor its other children)."""
        with self._lock:
            writer = self._writers.get(hop)
            if writer is None:
                if hop in self._alive:
                    self._waiting[hop].append(data)
                return
            writer.send(data)

    def _lost(self, index: int, why: str, *, connect: bool = False,
              error: Any = None) -> None:
        """Child ``index`` is gone: GONE for it and for every host below it."""
        with self._lock:
            if index not in self._alive:
                return
            self._alive.discard(index)
            self._waiting.pop(index, None)
            self._writers.pop(index, None)
            stream = self._streams.pop(index, None)
            if not self._alive and self._lingering is not None:
                self._lingering.put(None)  # `linger` waits for nothing else
        if stream is not None:
            stream.abort()
        name = str(self._children[index]["name"])
        below = [str(n["name"]) for n in self._below[index]]
        body: dict[str, Any] = {"host": index, "why": why}
        if connect:
            body["connect"] = {key: getattr(error, key, "")
                               for key in ("what", "where", "why", "fix")}
        self.up.send_json(wire.Kind.GONE, body)
        for node in self._below[index]:
            self.up.send_json(wire.Kind.GONE, {
                "host": int(node["index"]),
                "why": f"lost with its relay {name} (its subtree: {', '.join(below)}): {why}"})


class _StreamSink:
    """A child's stream as its `FrameWriter`'s sink (the stream writes all it is given)."""

    def __init__(self, stream: AgentStream) -> None:
        self.stream = stream

    def write(self, data: memoryview) -> int:
        self.stream.write(bytes(data))
        return len(data)
