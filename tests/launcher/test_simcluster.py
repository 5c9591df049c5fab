"""The simulated cluster (`testbed.simcluster`): the real head and real agents, fake PMI-1 ranks.

A job of 256 hosts x 8 ranks launches, fences twice, ends, and the head counts exactly the
frames the protocol implies, flat and through a tree of relays (`--fanout`: every host's frames
relayed, each fence merged so the head answers only the hosts it started, each get answered by
the nearest level that has the card); at 8 hosts the
simulator sends the head the same frames, kind by kind, as real agent processes with real rank
processes playing the same PMI-1 conversation.
Frames that follow the clock (heartbeats, periodic progress records, a barrier's stall reports
once it outlasts --pmi-stall on a loaded machine) are compared as present, not counted: their
number depends on how long each phase took.
"""

from __future__ import annotations

from typing import Any

import pytest

from launcher.pmi import KeyValueSpace, PmiProxy, Reply, Send
from launcher.pmi.kvs import PUSH_BYTES
from launcher.tree.shape import HEAD, Tree
from testbed import simjob
from testbed.simrank import (
    FENCED,
    SEGMENT_CHARS,
    SEGMENTS,
    WIRED,
    Conversation,
    card,
    host_card,
    peers,
    segment,
)

CLOCKED = {"HEARTBEAT", "PROGRESS", "PMI:stall", "PMI:stall_query", "PMI:stall_state"}


def _counted(result: dict[str, Any]) -> dict[str, dict[str, int]]:
    return {d: {k: n for k, n in kinds.items() if k not in CLOCKED}
            for d, kinds in simjob.frame_counts(result).items()}


def _expected(hosts: int, ranks: int, pushed: bool = False) -> dict[str, dict[str, int]]:
    """Per host: SPEC, START and BYE out, HELLO, READY and DONE in; per rank STARTED and EXIT;
    two fences (MPI_Init's and MPI_Finalize's), each one barrier_in per host up and one
    barrier_out per host down, and where the head ``pushed`` MPI_Init's cards to the hosts, one
    push per host ahead of its barrier_out; STDIN: rank 0's EOF (the head's stdin is not a
    terminal)."""
    return {"out": {"BYE": hosts, "PMI:barrier_out": 2 * hosts, "SPEC": hosts, "START": hosts,
                    "STDIN": 1, **({"PMI:push": hosts} if pushed else {})},
            "in": {"DONE": hosts, "EXIT": hosts * ranks, "HELLO": hosts,
                   "PMI:barrier_in": 2 * hosts, "READY": hosts, "STARTED": hosts * ranks}}


def _gets_at_head(hosts: int, ranks: int, fanout: int = 0) -> dict[int, int]:
    """Per host, the gets of peers' cards the head answers when a fence leaves the cards
    above (`launcher.pmi.kvs.PUSH_BYTES`): each is served by the nearest level that has the
    key - the rank's own host, then each relay from the host itself up (a relay holds its
    subtree's cards once the fence is answered) - and only the rest by the head."""
    tree = Tree(hosts, fanout)
    at_head = dict.fromkeys(range(hosts), 0)
    for rank in range(hosts * ranks):
        host = rank // ranks
        for peer in peers(rank, hosts * ranks):
            owner, level = peer // ranks, host if tree.children(host) else tree.parent(host)
            while owner != host and level != HEAD and owner not in tree.subtree(level):
                level = tree.parent(level)
            at_head[host] += owner != host and level == HEAD
    return at_head


def _lazy(expected: dict[str, dict[str, int]], gets: int) -> dict[str, dict[str, int]]:
    """``expected`` when MPI_Init's fence left the cards above and ``gets`` reached the head."""
    expected["in"]["PMI:get"] = expected["out"]["PMI:get_result"] = gets
    return expected


def _ended_well(result: dict[str, Any], hosts: int, ranks: int) -> None:
    assert result["code"] == 0, result["stderr_tail"]
    assert result["ranks_seen"] == hosts * ranks
    assert result["rank_codes"] == [0]
    assert result["fenced"] is not None and result["wired"] is not None  # every rank got there


def test_a_simulated_job_of_256_hosts_of_8_ranks_launches_fences_and_ends() -> None:
    # A long heartbeat interval: 256 hosts share this machine's cores with everything else,
    # and a starved simulator must not count as hosts lost (simjob.run_job).
    # Flat: the head starts every host (left to its default, 256 hosts would fan out).
    result = simjob.run_job(256, 8, timeout=300, heartbeat=30.0, extra=["--fanout", "0"])
    _ended_well(result, 256, 8)
    assert result["agents_seen"] == 256 and result["agent_codes"] == [0]
    # 2,048 cards are more than a fence pushes: each peer's card is read where it is.
    assert _counted(result) == _lazy(_expected(256, 8), sum(_gets_at_head(256, 8).values()))
    # Every agent sends its ranks' last progress records when they have all exited.
    assert simjob.frame_counts(result)["in"]["PROGRESS"] >= 256
    # The exit tail's parts are measured (`bench.sim_scale` reports them; never timed here):
    # the head read every DONE, and every simulated agent left before the head returned.
    parts = result["tail_parts"]
    assert parts is not None and {"loop", "reported", "seen", "dismiss", "after"} <= set(parts)
    assert result["agents_left"] is not None and result["agents_left"] <= result["head_exit"]
    # The head's start-up steps are stamped in order (connected, links adopted, SPECs out and
    # every READY back), and the simulator's own cost is reported beside the head's: its 4
    # processes' (64 hosts each) user and system CPU and their context switches.
    at = result["phases"]
    assert at["connect"] <= at["connected"] <= at["adopt"] <= at["adopted"] <= at["prepare"] \
        <= at["prepared"] <= at["loop"]
    use = result["workers_use"]
    assert use["user_s"] > 0 and use["sys_s"] > 0 and use["switches"] > 0


def test_a_simulated_tree_launch_of_256_hosts_relays_every_frame_and_merges_each_fence() -> None:
    hosts, ranks, fanout = 256, 8, 16  # two levels: the head starts 16, each of them 15
    result = simjob.run_job(hosts, ranks, timeout=300, heartbeat=30.0,
                            extra=["--fanout", str(fanout)])
    _ended_well(result, hosts, ranks)
    assert result["agents_seen"] == hosts and result["agent_codes"] == [0]
    counted = _counted(result)
    # The head's K streams carry the frames of the hosts below their relays ROUTED (counted
    # under their own kinds too): SPEC, START and BYE down, one write each, and the answers
    # to their gets that reached the head; what comes up is batched as it arrives. A host's
    # stream that ends after BYE may be reported GONE before the head stops reading. A job
    # that outlasts the heartbeat interval (a loaded machine) also carries the heartbeats the
    # head sent the hosts below (clocked: HEARTBEAT counts them with the relays' own).
    gets = _gets_at_head(hosts, ranks, fanout)
    routed_answers = sum(n for host, n in gets.items() if host >= fanout)
    beats = simjob.frame_counts(result)["out"].get("HEARTBEAT", 0)
    routed = counted["out"].pop("ROUTED") - (3 * (hosts - fanout) + routed_answers)
    assert 0 <= routed <= beats, (routed, beats)
    assert counted["in"].pop("ROUTED") > 0
    counted["in"].pop("GONE", None)
    expected = _expected(hosts, ranks)
    expected["out"]["SUBTREE"] = fanout  # one per relay the head starts, first
    # Each fence: one merged barrier_in per relay the head started, one answer to each; a
    # get reaches the head only when no relay on its way holds the card.
    expected["out"]["PMI:barrier_out"] = expected["in"]["PMI:barrier_in"] = 2 * fanout
    assert 0 < sum(gets.values()) < sum(_gets_at_head(hosts, ranks).values())
    assert counted == _lazy(expected, sum(gets.values()))


@pytest.mark.parametrize("fanout", [0, 4])
def test_hosts_whose_ranks_read_many_cards_fetch_them_all_once(fanout: int) -> None:
    """MPICH's default address exchange reads every card: 64 peers a rank here. Where the
    fence does not push the cards (72 hosts x 8 cards of 1,000 characters: 42 MB to send in
    all, over `launcher.pmi.kvs.PUSH_BYTES`), each host past the ski-rental point fetches
    every card at once (`launcher.pmi.proxy`); in a tree each relay sends one fetch up and
    answers the rest of its children itself. Every card a fake rank reads is checked against
    the one its peer put."""
    hosts, ranks, chars = 72, 8, 1000
    assert hosts * ranks * chars * hosts > PUSH_BYTES
    result = simjob.run_job(hosts, ranks, gets=64, timeout=300, heartbeat=30.0,
                            extra=["--fanout", str(fanout)], card_chars=chars)
    _ended_well(result, hosts, ranks)
    counted = _counted(result)
    fetches = counted["in"]["PMI:fetch"]
    assert counted["out"]["PMI:cards"] == fetches
    assert counted["in"]["PMI:get"] == counted["out"]["PMI:get_result"]
    if fanout:  # at most one per relay, and one per host the relays do not carry
        assert fetches <= len(Tree(hosts, fanout).relays()) + fanout
    else:
        assert fetches == hosts


@pytest.mark.parametrize("fanout", [0, 8])
def test_in_mpichs_exchange_each_host_fetches_every_card_at_its_first_miss(fanout: int) -> None:
    """MPICH's default exchange at 96 hosts x 2: 96 cards of 5 KB to 96 hosts are more than a
    fence pushes, so each host's first rank misses a key of MPICH's all-gather first
    (`launcher.pmi.actions.ALLGATHER_KEY`), fetches every card at once and reads the rest
    from its cache: no get goes up. Flat, the head answers every host's fetch; in a tree each
    relay sends one fetch up and answers its children's. Every card read is checked against
    the one its host put."""
    hosts, ranks = 96, 2
    assert hosts * sum(len(k) + len(v) for k, v in host_card(0)) * hosts > PUSH_BYTES
    result = simjob.run_job(hosts, ranks, gets=4, timeout=300, heartbeat=30.0,
                            extra=["--fanout", str(fanout)], exchange="mpich")
    _ended_well(result, hosts, ranks)
    counted = _counted(result)
    assert counted["out"]["PMI:cards"] == counted["in"]["PMI:fetch"]
    assert "PMI:get" not in counted["in"] and "PMI:get_result" not in counted["out"]
    if fanout:
        assert counted["in"]["PMI:fetch"] <= len(Tree(hosts, fanout).relays()) + fanout
    else:
        assert counted["in"]["PMI:fetch"] == hosts


def test_the_simulator_sends_the_head_the_frames_real_agents_send_at_8_hosts() -> None:
    real = simjob.run_job(8, 2, real=True, timeout=120)
    simulated = simjob.run_job(8, 2, timeout=120)
    _ended_well(real, 8, 2)
    _ended_well(simulated, 8, 2)
    assert _counted(simulated) == _counted(real) == _expected(8, 2, pushed=True)
    for result in (real, simulated):
        assert simjob.frame_counts(result)["in"]["PROGRESS"] >= 8


def test_simulated_hosts_join_a_rendezvous_head_with_the_token_and_run_the_same_job() -> None:
    """Rendezvous mode at scale: every simulated host joins the real listener (token
    handshake, roster); then the job's frames are those of a dispatched launch."""
    result = simjob.run_job(32, 2, rendezvous=True, timeout=300, heartbeat=30.0)
    _ended_well(result, 32, 2)
    assert result["agents_seen"] == 32 and result["agent_codes"] == [0]
    assert result["joined"] is not None and result["joined"] < result["running"]
    assert _counted(result) == _expected(32, 2, pushed=True)


def _play(talks: dict[int, Conversation], hosts: int, per_host: int,
          push_bytes: int = PUSH_BYTES) -> tuple[dict[int, list[str]], list[str], list[str]]:
    """Every rank's conversation played to its end against the agents' proxies and the head's
    key-value space (the pure cores): the marks each rank saw, the requests of every rank (in
    order) and the ops sent to the head."""
    world = hosts * per_host
    mapping = f"(vector,(0,{hosts},{per_host}))"
    proxies = [PmiProxy(ranks=[h * per_host + i for i in range(per_host)], world_size=world,
                        kvsname="kvs_t", process_mapping=mapping) for h in range(hosts)]
    kvs = KeyValueSpace(hosts=hosts, kvsname="kvs_t", push_bytes=push_bytes)
    for r in range(world):
        proxies[r // per_host].open(r, r)
    marks: dict[int, list[str]] = {r: [] for r in range(world)}
    sent: list[str] = []
    asked: list[str] = []
    waiting = list(range(world))

    def apply(host: int, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, Reply):
                mark = talks[action.conn].feed(action.data)
                assert mark is not None
                marks[action.conn].append(mark)
                if not talks[action.conn].done:
                    waiting.append(action.conn)
            else:
                assert isinstance(action, Send), action
                sent.append(action.msg["op"])
                for dest, msg in kvs.handle(host, action.msg):
                    apply(dest, proxies[dest].upstream(msg))

    while waiting:
        rank = waiting.pop(0)
        asked.append(f"{rank} {talks[rank].request().decode()}")
        apply(rank // per_host, proxies[rank // per_host].feed(rank, talks[rank].request()))
    assert all(t.done for t in talks.values())
    return marks, asked, sent


@pytest.mark.parametrize("gets", [0, 4])
def test_the_conversation_is_what_the_pmi_cores_answer_for_a_whole_world(gets: int) -> None:
    """Every rank of 3 hosts x 2 plays its conversation to the end, reading the right cards."""
    talks = {r: Conversation(r, 6, gets) for r in range(6)}
    marks, _, _ = _play(talks, 3, 2)
    for rank, seen in marks.items():
        assert FENCED in seen and (WIRED in seen) == (gets > 0)
        chosen = peers(rank, 6, gets)
        assert rank not in chosen and len(set(chosen)) == len(chosen) == gets
    assert card(3) != card(4)


@pytest.mark.parametrize("push_bytes", [PUSH_BYTES, 0])
def test_in_mpichs_exchange_each_hosts_first_rank_puts_its_card_and_reads_every_hosts(
        push_bytes: int) -> None:
    """MPICH's default exchange on 4 hosts x 3: the first rank of each host puts its host's
    10 keys and reads all 40, the others only fence; whether the fence pushes the cards or
    leaves them above (then the host's first miss fetches them all, and no get goes up)."""
    hosts, per_host = 4, 3
    talks = {r: Conversation(r, hosts * per_host, hosts, hosts=hosts)
             for r in range(hosts * per_host)}
    marks, asked, sent = _play(talks, hosts, per_host, push_bytes)
    for rank, seen in marks.items():
        first = rank % per_host == 0
        mine = [line.split()[1:] for line in asked if line.startswith(f"{rank} ")]
        puts = [words[2] for words in mine if words[0] == "cmd=put"]
        gets = [words[2] for words in mine if words[0] == "cmd=get" and "allgather" in words[2]]
        assert FENCED in seen and (WIRED in seen) == first
        assert puts == ([f"key={key}" for key, _ in host_card(rank // per_host)] if first else [])
        assert len(gets) == (10 * hosts if first else 0) and len(set(gets)) == len(gets)
    assert sent.count("barrier_in") == 2 * hosts
    assert sent.count("fetch") == (hosts if push_bytes == 0 else 0)
    assert sent.count("get") == 0
    # The segments are as compressible as MPICH's cards, and each host's are its own.
    assert host_card(1)[0] == ("-allgather-1-1", f"segments={SEGMENTS}")
    assert segment(1, 1) != segment(2, 1) and len(segment(3, 9)) == SEGMENT_CHARS


def test_the_head_counts_frames_by_kind_and_pmi_op_however_the_stream_splits_them() -> None:
    from launcher import wire
    from testbed.simhead import FrameCounter

    data = (wire.encode_json(wire.Kind.PMI, {"op": "barrier_out", "kv": {"bc-0": "x" * 300}})
            + wire.encode(wire.Kind.HEARTBEAT) + wire.encode_json(wire.Kind.EXIT, {"rank": 1}))
    whole, bytewise = FrameCounter(), FrameCounter()
    whole.feed("in", data)
    for i in range(len(data)):
        bytewise.feed("in", data[i:i + 1])
    assert whole.counts == bytewise.counts == {
        ("in", "PMI:barrier_out"): 1, ("in", "HEARTBEAT"): 1, ("in", "EXIT"): 1}
    assert sum(whole.bytes.values()) == sum(bytewise.bytes.values()) == len(data)


def test_one_decode_of_a_large_pmi_frame_serves_every_simulated_host_of_a_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from launcher import wire
    from testbed.simcluster import SHARED_DECODE_BYTES, share_decodes

    monkeypatch.setattr(wire.Frame, "json", wire.Frame.json)  # undone after the test
    share_decodes()

    def frame(kind: wire.Kind, obj: dict[str, Any]) -> wire.Frame:
        (decoded,) = wire.Decoder().feed(wire.encode_json(kind, obj))
        return decoded

    # Cards as MPICH's are: hex, which compresses to about half.
    cards = {"op": "cards", "kv": {f"-allgather-1-{h}": os.urandom(300).hex() for h in range(512)}}
    first, second = frame(wire.Kind.PMI, cards), frame(wire.Kind.PMI, cards)
    assert len(first.payload) >= SHARED_DECODE_BYTES
    assert first.json() == cards and first.json() is second.json()
    small = {"op": "get_result", "value": "v"}
    assert frame(wire.Kind.PMI, small).json() is not frame(wire.Kind.PMI, small).json()
    spec = {"hosts": cards["kv"]}
    assert frame(wire.Kind.SPEC, spec).json() is not frame(wire.Kind.SPEC, spec).json()


def test_hosts_that_get_the_same_large_frame_at_once_wait_for_one_decode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import threading
    import time

    from launcher import wire
    from testbed.simcluster import share_decodes

    decodes = []
    plain = wire.Frame.json

    def slow_decode(frame: wire.Frame) -> dict[str, Any]:
        decodes.append(frame)
        time.sleep(0.05)  # long enough that every host's thread arrives during it
        return plain(frame)

    monkeypatch.setattr(wire.Frame, "json", slow_decode)  # undone after the test
    share_decodes()
    cards = {"op": "cards", "kv": {f"-allgather-1-{h}": os.urandom(300).hex() for h in range(512)}}
    data = wire.encode_json(wire.Kind.PMI, cards)
    copies = [wire.Decoder().feed(data)[0] for _ in range(8)]  # each host's own bytes
    start = threading.Barrier(len(copies))
    got: list[dict[str, Any]] = []

    def host(frame: wire.Frame) -> None:
        start.wait()
        got.append(frame.json())

    threads = [threading.Thread(target=host, args=(frame,)) for frame in copies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(decodes) == 1
    assert len(got) == 8 and all(value is got[0] for value in got) and got[0] == cards
