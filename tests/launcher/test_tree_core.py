"""Fan-out's pure cores and its two adapters over in-memory streams: the tree's shape, the
fence merged per relay against the head's key-value space, the head's relay line and a relay
with fake children (`launcher.tree`)."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading

import pytest

from launcher import wire
from launcher.agent.writer import FrameWriter
from launcher.errors import ConnectError, PmiError
from launcher.pmi.kvs import KeyValueSpace
from launcher.tree.fence import SubtreeFence
from launcher.tree.head import RelayLine
from launcher.tree.relay import Relay
from launcher.tree.shape import AUTO_FANOUT, AUTO_FLAT_MAX, HEAD, Tree, choose_fanout

K = wire.Kind


# -- shape ------------------------------------------------------------------------------------
@pytest.mark.parametrize("hosts, fanout", [(1, 2), (16, 2), (17, 3), (100, 4), (1000, 32)])
def test_every_host_has_one_parent_and_is_in_its_subtree(hosts, fanout):
    tree = Tree(hosts, fanout)
    seen = [h for parent in [HEAD, *range(hosts)] for h in tree.children(parent)]
    assert sorted(seen) == list(range(hosts))  # started once each
    for host in range(hosts):
        assert host in tree.children(tree.parent(host))
        assert len(tree.children(host)) <= fanout
        for below in tree.subtree(host)[1:]:
            assert tree.next_hop(host, below) in tree.children(host)
    assert len(tree.children(HEAD)) == min(fanout, hosts)


def test_sixteen_hosts_at_fanout_two_make_four_levels_and_seven_relays():
    tree = Tree(16, 2)
    assert list(tree.children(HEAD)) == [0, 1] and list(tree.children(1)) == [4, 5]
    assert tree.subtree(1) == [1, 4, 5, 10, 11, 12, 13]
    assert tree.relays() == [0, 1, 2, 3, 4, 5, 6]
    assert max(tree.depth(h) for h in range(16)) == 4
    assert tree.next_hop(1, 12) == 5 and tree.next_hop(HEAD, 12) == 1
    lines = tree.describe([f"node{i}" for i in range(1, 17)])
    assert lines[0] == "fan-out 2: 7 relays, depth 4"
    assert "  head -> node1, node2" in lines and "    node2 -> node5, node6" in lines


def test_the_default_is_flat_for_small_launches_and_zero_is_always_flat():
    assert choose_fanout(None, AUTO_FLAT_MAX) == 0
    assert choose_fanout(None, AUTO_FLAT_MAX + 1) == AUTO_FANOUT
    assert choose_fanout(0, 5000) == 0 and choose_fanout(4, 3) == 4
    assert Tree(3, 4).flat and Tree(1000, 0).flat and list(Tree(5, 0).children(HEAD)) == [
        0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        Tree(4, 2).next_hop(0, 1)


# -- the fence through the tree ---------------------------------------------------------------
def _fences(tree: Tree) -> dict[int, SubtreeFence]:
    fences = {}
    for relay in tree.relays():
        fences[relay] = SubtreeFence(relay, {h: (relay if h == relay else tree.next_hop(
            relay, h)) for h in tree.subtree(relay)})
        for h in tree.subtree(relay):
            fences[relay].spec(h, {"ranks": [{"rank": h}], "pmi": {"mode": "fd",
                                                                   "kvsname": "job-0"}})
    return fences


def _up(tree: Tree, fences: dict[int, SubtreeFence], host: int, msg: dict) -> list[tuple]:
    """``host``'s barrier_in climbs through the relays: what reaches the head, from whom. A
    relay's own agent enters its own fence, any other host its parent's."""
    sender, relay = host, host if host in fences else tree.parent(host)
    while relay != HEAD:
        merged = fences[relay].enter(sender, msg)
        if merged is None:
            return []
        sender, msg, relay = relay, merged, tree.parent(relay)
    return [(sender, msg)]


def _down(tree: Tree, fences: dict[int, SubtreeFence], hop: int, msg: dict,
          got: dict[int, list]) -> None:
    if "hosts" not in msg:
        got.setdefault(hop, []).append(msg)
        return
    for target, body in fences[hop].out(msg):
        if target == hop:
            got.setdefault(hop, []).append(body)
        else:
            _down(tree, fences, target, body, got)


@pytest.mark.parametrize("hosts, fanout", [(16, 2), (40, 3), (7, 2)])
def test_a_fence_through_the_tree_costs_the_head_one_message_per_host_it_started(
        hosts, fanout):
    tree, kvs = Tree(hosts, fanout), KeyValueSpace(hosts=hosts, kvsname="job-0")
    fences = _fences(tree)
    at_head: list[tuple] = []
    for host in range(hosts):  # relays enter before their subtrees: they wait for them
        at_head += _up(tree, fences, host, {"op": "barrier_in", "puts": {f"card{host}": "x"}})
    assert len(at_head) == len(tree.children(HEAD))  # one aggregate per top relay
    replies = [r for sender, msg in at_head for r in kvs.handle(sender, msg)]
    assert len(replies) == len(tree.children(HEAD))
    got: dict[int, list] = {}
    for hop, msg in replies:
        _down(tree, fences, hop, msg, got)
    cards = {f"card{h}": "x" for h in range(hosts)}
    assert got == {h: [{"op": "push", "kv": cards}, {"op": "barrier_out", "kv": {}}]
                   for h in range(hosts)}  # each host its cards, then its release
    # A get from below is answered by the relay that passed the cards down.
    relay = tree.relays()[-1]
    child = tree.children(relay)[0]
    assert fences[relay].get(child, "card0") == "x" and fences[relay].get(child, "nope") is None


def test_a_relay_waits_for_every_host_of_its_subtree_that_takes_part():
    fence = SubtreeFence(0, {0: 0, 1: 1, 2: 2})
    for host, ranks in ((0, [0]), (1, [1]), (2, [])):  # host 2: a spare's check, no ranks
        fence.spec(host, {"ranks": ranks, "pmi": {"mode": "fd", "kvsname": "k"}})
    assert fence.enter(1, {"op": "barrier_in", "puts": {"b": "2"}}) is None
    assert fence.enter(0, {"op": "barrier_in", "puts": {"a": "1"}}) == {
        "op": "barrier_in", "puts": {"b": "2", "a": "1"}, "hosts": [0, 1]}


def test_the_head_answers_an_aggregate_once_and_refuses_a_host_entering_twice():
    kvs = KeyValueSpace(hosts=4, kvsname="k")
    assert kvs.handle(0, {"op": "barrier_in", "puts": {"a": "1"}, "hosts": [0, 2, 3]}) == []
    out = kvs.handle(1, {"op": "barrier_in", "puts": {"b": "2"}})
    assert out == [(0, {"op": "barrier_out", "kv": {"a": "1", "b": "2"}, "hosts": [0, 2, 3]}),
                   (1, {"op": "barrier_out", "kv": {"a": "1", "b": "2"}})]
    kvs.handle(0, {"op": "barrier_in", "puts": {}, "hosts": [0, 1]})
    with pytest.raises(PmiError, match="host 1 entered barrier 1 twice"):
        kvs.handle(1, {"op": "barrier_in", "puts": {}})
    with pytest.raises(PmiError, match="outside the job"):
        KeyValueSpace(hosts=2, kvsname="k").handle(0, {"op": "barrier_in", "puts": {},
                                                       "hosts": [0, 7]})


# -- in-memory streams ------------------------------------------------------------------------
class Pipe:
    """One end of an in-memory AgentStream pair: writes land in ``peer``'s reads."""

    is_local = False
    connection = None

    def __init__(self, host: str = "fake") -> None:
        self.host = host
        self.inbox: queue.Queue[bytes] = queue.Queue()
        self.peer: Pipe | None = None
        self.closed = False

    @classmethod
    def pair(cls, host: str) -> tuple[Pipe, Pipe]:
        a, b = cls(host), cls(host)
        a.peer, b.peer = b, a
        return a, b

    def write(self, data: bytes) -> None:
        if self.closed:
            raise OSError("closed")
        assert self.peer is not None
        self.peer.inbox.put(data)

    def read(self, max_bytes: int = 65536) -> bytes:
        return self.inbox.get()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.peer is not None:
                self.peer.inbox.put(b"")

    abort = close

    def wait(self, timeout=None):
        return 0

    def kill(self) -> None:
        self.close()

    def stderr_text(self) -> str:
        return ""

    def transport_error(self):
        return None


def _frames(pipe: Pipe, count: int, timeout: float = 5.0) -> list[wire.Frame]:
    decoder, out = wire.Decoder(), []
    while len(out) < count:
        data = pipe.inbox.get(timeout=timeout)
        if not data:
            break
        out += decoder.feed(data)
    return out


def test_the_head_sorts_a_relay_line_into_one_stream_per_host_and_names_a_lost_subtree():
    head_end, relay_end = Pipe.pair("node1")
    line = RelayLine(head_end, 0, {0: "node1", 2: "node3", 5: "node6"},
                     {2: "10.0.0.3", 5: "10.0.0.6"})
    line.start()
    s = line.streams
    relay_end.write(wire.encode(K.HELLO, b"{}") + wire.encode_routed(
        5, wire.encode(K.READY, b"{}")))
    assert s[0].read() == wire.encode(K.HELLO, b"{}")
    assert s[5].read() == wire.encode(K.READY, b"{}")
    s[2].write(wire.encode(K.KILL))  # to a host below: ROUTED; to the relay: as it is
    s[0].write(wire.encode(K.BYE))
    got = _frames(relay_end, 2)
    assert wire.decode_routed(got[0]) == (2, wire.encode(K.KILL)) and got[1].kind is K.BYE
    assert s[2].connection is not None and s[2].connection.peer_address() == "10.0.0.3"
    relay_end.write(wire.encode_json(K.GONE, {"host": 2, "why": "no route", "connect": {
        "what": "cannot connect to node3", "where": "root@10.0.0.3:22", "why": "refused",
        "fix": "check sshd"}}))
    assert s[2].read() == b""
    error = s[2].transport_error()
    assert isinstance(error, ConnectError) and "cannot connect to node3" in str(error)
    relay_end.close()  # the relay dies: its own stream and the rest of its subtree end
    assert s[5].read() == b"" and s[0].read() == b""
    assert "lost with its relay node1 (its subtree: node3, node6)" in s[5].stderr_text()
    assert "its subtree is lost with it: node3, node6" in s[0].stderr_text()


def test_the_heads_links_to_hosts_behind_a_relay_have_no_reader_threads_of_their_own():
    from launcher.head.agent_link import Fleet, Received

    head_end, relay_end = Pipe.pair("node1")
    line = RelayLine(head_end, 0, {0: "node1", 1: "node2", 2: "node3"},
                     {1: "10.0.0.2", 2: "10.0.0.3"})
    line.start()
    relay_end.write(wire.encode(K.HELLO, b"{}"))  # before the head listens: kept, then first
    before = threading.active_count()
    fleet = Fleet()
    links = [fleet.add(line.streams[i]) for i in range(3)]
    assert threading.active_count() == before
    relay_end.write(wire.encode(K.READY, b"{}") + wire.encode_routed(
        1, wire.encode(K.HELLO, b"{}") + wire.encode(K.READY, b"{}")))
    relay_end.write(wire.encode_routed(2, b"\x00\x00\x00\x00\x07"))  # length 0: broken
    relay_end.write(wire.encode_routed(1, wire.encode(K.DONE)))
    events = [fleet.events.get(timeout=5) for _ in range(6)]
    got = [(e.host, e.frame.kind if isinstance(e, Received) else "closed") for e in events]
    assert [g for g in got if g[0] == 0] == [(0, K.HELLO), (0, K.READY)]
    assert [g for g in got if g[0] == 1] == [(1, K.HELLO), (1, K.READY), (1, K.DONE)]
    assert [g for g in got if g[0] == 2] == [(2, "closed")]  # that host's stream only
    relay_end.close()
    ends = sorted(fleet.events.get(timeout=5).host for _ in range(2))
    assert ends == [0, 1] and links[2].stream.wait(1) == 0  # every end once, 2's already


def test_the_head_closes_a_relay_line_when_its_last_host_is_closed():
    head_end, relay_end = Pipe.pair("node1")
    line = RelayLine(head_end, 0, {0: "node1", 1: "node2"}, {1: "10.0.0.2"})
    line.streams[0].close()
    assert not head_end.closed
    line.streams[1].close()
    assert head_end.closed


def test_only_a_relays_own_stream_of_a_line_with_hosts_below_says_it_relays():
    """The supervisor lets a done host leave at once, but not a relay that still carries
    its subtree's streams (`launcher.head.supervisor`)."""
    line = RelayLine(Pipe.pair("node1")[0], 0, {0: "node1", 1: "node2"}, {1: "10.0.0.2"})
    alone = RelayLine(Pipe.pair("node3")[0], 2, {2: "node3"}, {})
    assert line.streams[0].relays and not line.streams[1].relays
    assert not alone.streams[2].relays


class Upward:
    """The relay's link to its parent, recorded."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.event = threading.Event()

    def send(self, data: bytes) -> bool:
        self.sent.append(data)
        self.event.set()
        return True

    def send_json(self, kind, obj=None) -> bool:
        return self.send(wire.encode_json(kind, obj))

    send_output_frame = forward = send

    def frames(self) -> list[wire.Frame]:
        return wire.Decoder().feed(b"".join(self.sent))


def _wait(predicate, timeout: float = 5.0) -> None:
    deadline = threading.Event()
    timer = threading.Timer(timeout, deadline.set)
    timer.start()
    try:
        while not predicate():
            assert not deadline.wait(0.01), "condition never held"
    finally:
        timer.cancel()


def test_a_relay_routes_both_ways_merges_its_fence_and_reports_a_lost_child():
    # Relay 0 starts hosts 1 (a relay of host 3) and 2; the fakes are their agents' ends.
    body = {"index": 0, "python": "/usr/bin/python3", "children": [
        {"index": 1, "name": "node2", "hop": {}, "children": [
            {"index": 3, "name": "node4", "hop": {}, "children": []}]},
        {"index": 2, "name": "node3", "hop": {}, "children": []}]}
    ends = {i: Pipe.pair(f"node{i + 1}") for i in (1, 2)}
    up, own = Upward(), []
    relay = Relay(body, up, own.append, connect=lambda node: ends[node["index"]][0],
                  writer=FrameWriter)
    relay.start()
    spec = {"ranks": [{"rank": 0}], "pmi": {"mode": "fd", "kvsname": "k"}}
    relay.own_spec(spec)
    for host in (1, 2, 3):
        relay.down(wire.Frame(K.ROUTED, wire.encode_routed(host, wire.encode_json(
            K.SPEC, spec))[5:]))
    child1, child2 = ends[1][1], ends[2][1]
    first = _frames(child1, 3)  # SUBTREE first, its own SPEC, then the one for host 3
    assert [f.kind for f in first] == [K.SUBTREE, K.SPEC, K.ROUTED]
    assert first[0].json()["children"][0]["name"] == "node4"
    assert wire.decode_routed(first[2])[0] == 3
    assert _frames(child2, 1)[0].kind is K.SPEC  # a leaf gets its frames unwrapped
    # Up: a leaf's frames go up ROUTED; a child relay's ROUTED as it is.
    child2.write(wire.encode_json(K.STARTED, {"rank": 2, "pid": 9}))
    child1.write(wire.encode_routed(3, wire.encode(K.HEARTBEAT)))
    _wait(lambda: len([f for f in up.frames() if f.kind is K.ROUTED
                       and wire.decode_routed(f)[0] in (2, 3)]) >= 2)
    # The fence: host 1's aggregate covers host 3; the relay answers once everyone entered.
    child1.write(wire.encode_json(K.PMI, {"op": "barrier_in", "puts": {"c1": "1", "c3": "3"},
                                          "hosts": [1, 3]}))
    child2.write(wire.encode_json(K.PMI, {"op": "barrier_in", "puts": {"c2": "2"}}))
    relay.own_barrier({"op": "barrier_in", "puts": {"c0": "0"}})
    _wait(lambda: any(f.kind is K.PMI for f in up.frames()))
    [aggregate] = [f.json() for f in up.frames() if f.kind is K.PMI]
    assert aggregate["hosts"] == [0, 1, 2, 3] and len(aggregate["puts"]) == 4
    kv = {"c0": "0", "c1": "1", "c2": "2", "c3": "3"}
    relay.fence_out({"op": "barrier_out", "kv": kv, "hosts": [0, 1, 2, 3]})
    assert own == [{"op": "push", "kv": kv}, {"op": "barrier_out", "kv": {}}]
    assert _frames(child1, 1)[0].json() == {"op": "barrier_out", "kv": kv, "hosts": [1, 3]}
    assert [f.json() for f in _frames(child2, 2)] == [{"op": "push", "kv": kv},
                                                      {"op": "barrier_out", "kv": {}}]
    # A get for a card the relay passed down is answered here.
    child2.write(wire.encode_json(K.PMI, {"op": "get", "key": "c3", "req": 4}))
    assert _frames(child2, 1)[0].json() == {"op": "get_result", "req": 4, "found": True,
                                            "value": "3"}
    # Host 1 (the relay of host 3) dies: both reported GONE, host 3 naming its relay.
    child1.close()
    _wait(lambda: sum(f.kind is K.GONE for f in up.frames()) == 2)
    gone = {f.json()["host"]: f.json()["why"] for f in up.frames() if f.kind is K.GONE}
    assert "stream closed" in gone[1] and "lost with its relay node2" in gone[3]
    relay.close()
    assert child2.inbox.get(timeout=5) == b""  # the remaining child sees its stream end


def test_a_relay_forwards_every_card_as_it_came_to_the_fetches_that_waited_for_it():
    # Relay 0 starts leaves 1 and 2; a fence left the cards above, and both fetch them.
    body = {"index": 0, "python": "/usr/bin/python3", "children": [
        {"index": i, "name": f"node{i + 1}", "hop": {}, "children": []} for i in (1, 2)]}
    ends = {i: Pipe.pair(f"node{i + 1}") for i in (1, 2)}
    up = Upward()
    relay = Relay(body, up, [].append, connect=lambda node: ends[node["index"]][0],
                  writer=FrameWriter)
    relay.start()
    spec = {"ranks": [{"rank": 0}], "pmi": {"mode": "fd", "kvsname": "k"}}
    relay.own_spec(spec)
    for host in (1, 2):
        relay.down(wire.Frame(K.ROUTED, wire.encode_routed(host, wire.encode_json(
            K.SPEC, spec))[5:]))
    child1, child2 = ends[1][1], ends[2][1]
    assert [f.kind for c in (child1, child2) for f in _frames(c, 1)] == [K.SPEC, K.SPEC]
    child1.write(wire.encode_json(K.PMI, {"op": "fetch"}))
    _wait(lambda: any(f.kind is K.ROUTED for f in up.frames()))
    child2.write(wire.encode_json(K.PMI, {"op": "fetch"}))  # waits for the first one's cards
    # The head's answer to host 1: every card, compressed, passing down through the relay.
    cards = {f"-allgather-1-{h}-seg-{s}/9": f"{h:04x}{s:02x}" * 90 for h in range(64)
             for s in range(1, 10)}
    answer = wire.encode_json(K.PMI, {"op": "cards", "kv": cards})
    assert answer[5:6] == wire.COMPRESSED
    relay.down(wire.Frame(K.ROUTED, wire.encode_routed(1, answer)[5:]))
    for child in (child1, child2):  # the same bytes, neither decoded nor encoded again
        (frame,) = _frames(child, 1)
        assert wire.encode(frame.kind, frame.payload) == answer
    # Only host 1's fetch went up; the relay then serves gets and fetches from those cards.
    fetches = [f for f in up.frames() if f.kind is K.ROUTED
               and wire.Decoder().feed(wire.decode_routed(f)[1])[0].kind is K.PMI]
    assert [wire.decode_routed(f)[0] for f in fetches] == [1]
    child2.write(wire.encode_json(K.PMI, {"op": "get", "key": "-allgather-1-5-seg-2/9",
                                          "req": 4}))
    assert _frames(child2, 1)[0].json()["value"] == cards["-allgather-1-5-seg-2/9"]
    child1.write(wire.encode_json(K.PMI, {"op": "fetch"}))
    (again,) = _frames(child1, 1)
    assert wire.encode(again.kind, again.payload) == answer
    relay.close()


def test_a_fence_that_leaves_the_cards_above_lets_each_relay_serve_its_own_subtrees_cards():
    tree = Tree(16, 2)
    kvs = KeyValueSpace(hosts=16, kvsname="job-0", push_bytes=0)
    fences = _fences(tree)
    at_head: list[tuple] = []
    for host in range(16):
        at_head += _up(tree, fences, host, {"op": "barrier_in", "puts": {f"card{host}": "x"}})
    got: dict[int, list] = {}
    for hop, answer in (r for sender, msg in at_head for r in kvs.handle(sender, msg)):
        _down(tree, fences, hop, answer, got)
    held = len("card0x") * 10 + len("card10x") * 6
    assert got == {h: [{"op": "barrier_out", "kv": {}, "held": held}] for h in range(16)}
    for relay, fence in fences.items():
        child = tree.children(relay)[0]
        for host in range(16):
            expected = "x" if host in tree.subtree(relay) else None
            assert fence.get(child, f"card{host}") == expected


def test_a_relay_sends_one_fetch_up_and_answers_the_others_when_its_cards_pass_down():
    fence = SubtreeFence(0, {0: 0, 1: 1, 2: 2})
    for host in range(3):
        fence.spec(host, {"ranks": [{"rank": host}], "pmi": {"mode": "fd", "kvsname": "k"}})
    assert fence.fetch(1) is None and fence.fetch_waits(1) is False  # goes up
    assert fence.fetch(2) is None and fence.fetch_waits(2) is True   # waits
    # Cards passing to another host (a fetch sent up by a relay further down) are kept but
    # answer nobody here; those for the fetch this relay sent up answer the one waiting,
    # with the frame that carried them, as it came.
    assert fence.cards_passing(2, b"frame-a") == []
    assert fence.cards_passing(1, b"frame-b") == [2]
    fence.cards(1, {"b": "2"})
    assert fence.get(0, "b") == "2"
    # Until the next fence, every card is here: a fetch is answered at once, with that frame.
    assert fence.fetch(2) == fence.fetch(1) == b"frame-b"
    fence.out({"op": "barrier_out", "kv": {}, "held": 9, "hosts": [0, 1, 2]})
    assert fence.fetch(2) is None


def test_a_relay_sends_every_host_its_cards_before_any_release():
    fence = SubtreeFence(0, {0: 0, 1: 1, 2: 2, 3: 3})
    for host in range(4):
        fence.spec(host, {"ranks": [host], "pmi": {"mode": "fd", "kvsname": "k"}})
    out = fence.out({"op": "barrier_out", "kv": {"a": "1"}, "hosts": [0, 1, 2, 3]})
    assert [(h, b["op"]) for h, b in out] == [(h, op) for op in ("push", "barrier_out")
                                              for h in range(4)]


class SocketChild:
    """A relay's pollable stream to a child (a socketpair): ``far`` is the child agent's end."""

    is_local = False
    connection = None

    def __init__(self, host: str) -> None:
        self.host = host
        self.near, self.far = socket.socketpair()

    def reader_fd(self) -> int:
        return self.near.fileno()

    def read_ready(self, max_bytes: int = 65536) -> bytes | None:
        try:
            return self.near.recv(max_bytes, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None

    def write(self, data: bytes) -> None:
        self.near.sendall(data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.near.shutdown(socket.SHUT_WR)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.near.shutdown(socket.SHUT_RDWR)

    def stderr_text(self) -> str:
        return ""


def test_a_relay_reads_every_pollable_child_on_one_thread_in_order_and_reports_each_end():
    children = 24
    body = {"index": 0, "python": "/usr/bin/python3", "children": [
        {"index": i, "name": f"node{i + 1}", "hop": {}, "children": []}
        for i in range(1, children + 1)]}
    ends = {i: SocketChild(f"node{i + 1}") for i in range(1, children + 1)}
    up = Upward()
    relay = Relay(body, up, [].append, connect=lambda node: ends[node["index"]],
                  writer=FrameWriter)
    before = set(threading.enumerate())
    relay.start()
    _wait(lambda: len(relay._writers) == children, timeout=30)
    names = [t.name for t in threading.enumerate() if t not in before]
    assert not any(n.startswith("relay-") and n[6:].isdigit() for n in names)  # no reader each
    assert names.count("agent-streams") == 1  # one reads them all (a writer each stays)
    for turn in range(5):
        for i, child in ends.items():
            child.far.sendall(wire.encode_json(K.PROGRESS, {"host": i, "turn": turn}))
    for child in ends.values():
        child.far.close()
    _wait(lambda: sum(f.kind is K.GONE for f in up.frames()) == children, timeout=30)
    seen: dict[int, list[int]] = {}
    for frame in up.frames():
        if frame.kind is K.ROUTED:
            host, inner = wire.decode_routed(frame)
            seen.setdefault(host, []).extend(f.json()["turn"] for f in wire.Decoder().feed(inner))
    assert seen == {i: [0, 1, 2, 3, 4] for i in ends}  # each child's frames in its order
    gone = [f.json() for f in up.frames() if f.kind is K.GONE]
    assert sorted(g["host"] for g in gone) == list(ends)
    assert all(g["why"] == "its agent's stream closed" for g in gone)
    relay.close()


def _relay_of(ends: dict[int, SocketChild]) -> Relay:
    body = {"index": 0, "python": "/usr/bin/python3", "children": [
        {"index": i, "name": child.host, "hop": {}, "children": []}
        for i, child in ends.items()]}
    relay = Relay(body, Upward(), [].append, connect=lambda node: ends[node["index"]],
                  writer=FrameWriter)
    relay.start()
    _wait(lambda: len(relay._writers) == len(ends), timeout=30)
    return relay


def test_a_lingering_relay_leaves_when_its_last_child_is_lost_though_nothing_else_arrives():
    ends = {i: SocketChild(f"node{i + 1}") for i in (1, 2)}
    relay = _relay_of(ends)
    events: queue.Queue = queue.Queue()  # the agent's events: nothing more comes from above
    lingering = threading.Thread(target=relay.linger, args=(events, lambda event: False))
    lingering.start()
    for child in ends.values():
        child.far.close()
    lingering.join(timeout=30)  # it waits for no poll: a missed wake-up would never end
    assert not lingering.is_alive()
    relay.close()


class ProcessChild(SocketChild):
    """A child whose stream runs in a process of the relay's agent (an `ssh`)."""

    pid = 4321


def test_a_relay_spawns_only_when_its_childrens_streams_are_processes_of_its_own():
    channels = _relay_of({1: SocketChild("node2")})  # paramiko: channels, no process
    processes = _relay_of({1: ProcessChild("node2")})
    assert not channels.spawns and channels.transport_pids() == frozenset()
    assert processes.spawns and processes.transport_pids() == {4321}
    for relay in (channels, processes):
        relay.close()
