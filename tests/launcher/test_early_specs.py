"""Each host's SPEC as its stream opens (`launcher.head.early`): sent at once (host 0's once
host 1 is open too: its probe), heartbeats to opened agents until the phase ends, and a
start-up that sends only the SPECs not sent yet, with scripted agents on in-memory streams."""

from __future__ import annotations

import io
import threading
import time

from launcher import wire
from launcher.head.agent_link import Fleet
from launcher.head.early import EarlySpecs
from launcher.head.startup import early_spec_for, spec_frame
from launcher.head.supervisor import Supervisor
from launcher.hosts.hostfile import parse_host_list
from launcher.hosts.selection import select_hosts
from launcher.output.sink import OutputSink
from launcher.plan.job import make_plan
from tests.launcher.test_head_core import BEAT, OPTS
from tests.support.scripted_agents import MemoryAgentStream, Script, ScriptedAgent

K = wire.Kind


class Written:
    """A stream that keeps what is written to it; ``broken`` refuses every write."""

    def __init__(self, host: str, broken: bool = False) -> None:
        self.host, self.broken = host, broken
        self.frames: list[bytes] = []
        self.lock = threading.Lock()

    def write(self, data: bytes) -> None:
        if self.broken:
            raise OSError("gone")
        with self.lock:
            self.frames.append(data)

    def kinds(self) -> list[str]:
        with self.lock:
            return ["beat" if f == wire.encode(K.HEARTBEAT) else f.decode() for f in self.frames]


def spec_for(index: int, first) -> bytes | None:
    if index == 3:
        return None  # too large to go before its agent reads
    probe = f"+{first[1].host}" if index == 0 else ""
    return f"SPEC{index}{probe}".encode()


def test_each_spec_goes_as_its_stream_opens_and_host_0s_once_host_1_is_open_too():
    early = EarlySpecs(4, spec_for, heartbeat=60.0)
    streams = [Written(f"h{i}") for i in range(4)]
    early.opened(2, streams[2])
    early.opened(0, streams[0])
    assert streams[2].kinds() == ["SPEC2"] and streams[0].kinds() == []  # 0 waits for 1
    early.opened(1, streams[1])
    assert streams[1].kinds() == ["SPEC1"] and streams[0].kinds() == ["SPEC0+h1"]
    early.opened(3, streams[3])  # its SPEC is the start-up's
    assert early.stop() == {0: b"SPEC0+h1", 1: b"SPEC1", 2: b"SPEC2"}
    assert streams[3].kinds() == []


def test_a_single_hosts_spec_goes_at_once_and_a_broken_stream_is_left_to_the_start_up():
    early = EarlySpecs(1, lambda i, first: b"ONLY", heartbeat=60.0)
    early.opened(0, Written("h0"))
    assert early.stop() == {0: b"ONLY"}
    broken = EarlySpecs(2, spec_for, heartbeat=60.0)
    broken.opened(1, Written("h1", broken=True))
    assert broken.stop() == {}


def test_opened_agents_hear_heartbeats_until_every_stream_is_open_and_none_after():
    early = EarlySpecs(3, spec_for, heartbeat=0.02)
    first = Written("h1")
    early.opened(1, first)
    time.sleep(0.2)
    later = Written("h2")
    early.opened(2, later)
    time.sleep(0.1)
    early.stop()
    heard = first.kinds()
    assert heard[0] == "SPEC1" and heard.count("beat") >= 3 and set(heard[1:]) == {"beat"}
    assert later.kinds()[0] == "SPEC2" and "beat" in later.kinds()
    count = len(first.kinds())
    time.sleep(0.1)
    assert len(first.kinds()) == count  # the links' own heartbeats from here on


def test_a_start_up_sends_only_the_specs_that_did_not_go_as_the_streams_opened():
    names = ["node0", "node1", "node2"]
    selected = select_hosts(parse_host_list(",".join(f"{n}:2" for n in names)))
    plan = make_plan(selected, argv=["train"], cwd="/", job_id="job", base_env={})
    streams = [MemoryAgentStream(n) for n in names]
    master = ("10.0.0.1", 29500)
    early = EarlySpecs(3, early_spec_for(plan, OPTS, master), heartbeat=BEAT)
    early.opened(1, streams[1])  # host 0's waits for host 1: sent here too
    early.opened(0, streams[0])  # host 2 opened "late": its SPEC is the start-up's
    sent = early.stop()
    assert sorted(sent) == [0, 1]
    assert sent[0] == spec_frame(plan, 0, OPTS, streams[:2], master)  # what it would send
    agents = [ScriptedAgent(s, Script({2 * i: 0, 2 * i + 1: 0}), beat=BEAT)
              for i, s in enumerate(streams)]
    fleet = Fleet()
    links = [fleet.add(s) for s in streams]
    for number, link in enumerate(links):
        link.early_spec = number in sent
    sink = OutputSink({r.rank: r.host for r in plan.ranks}, io.BytesIO(), io.BytesIO())
    outcome = Supervisor(fleet, links, plan, sink, OPTS).run(master)
    assert outcome.exit_code == 0
    assert [agent.received.count(K.SPEC) for agent in agents] == [1, 1, 1]
    assert not any(link.early_spec for link in links)  # a later round sends its own
