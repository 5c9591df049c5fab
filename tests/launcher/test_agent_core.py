"""The agent's core over a pair of pipes: spec checks, silence, BYE, queries, EOF.

The real `Agent` and its real `HeadLink` run in a thread of this process; the test plays the
head on the other ends of two pipes. Only the start-failure test asks the agent to start a
rank (a program the kernel refuses to execute), so no rank ever runs, and an agent none of whose
ranks started never takes this test process's children for the job's (it would stop them).
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from launcher import wire
from launcher.agent.head_link import HeadLink
from launcher.agent.main import Agent

K = wire.Kind


@dataclass
class Head:
    """The test's end: frames to the agent, frames from it, and the agent's exit code."""

    to_agent: Any
    from_agent: int
    result: queue.Queue[int]

    def send(self, kind: wire.Kind, body: dict[str, Any] | None = None) -> None:
        self.to_agent.write(wire.encode_json(kind, body))

    def frames(self, timeout: float = 5.0) -> Iterator[wire.Frame]:
        decoder = wire.Decoder()
        while data := os.read(self.from_agent, 65536):
            yield from decoder.feed(data)

    def next_frame(self, *skip: wire.Kind) -> wire.Frame:
        for frame in self.frames():
            if frame.kind not in (K.HEARTBEAT, *skip):
                return frame
        raise AssertionError("the agent closed its stream")


@pytest.fixture
def head() -> Iterator[Head]:
    to_agent_r, to_agent_w = os.pipe()
    from_agent_r, from_agent_w = os.pipe()
    agent = Agent(lambda events: HeadLink(events, lambda size: os.read(to_agent_r, size),
                                          os.fdopen(from_agent_w, "wb", buffering=0)))
    result: queue.Queue[int] = queue.Queue()
    threading.Thread(target=lambda: result.put(agent.run()), daemon=True).start()
    writer = os.fdopen(to_agent_w, "wb", buffering=0)
    yield Head(writer, from_agent_r, result)
    writer.close()
    os.close(from_agent_r)


def spec(cwd: str = "/", argv: tuple[str, ...] = (sys.executable,), beat: float = 5.0
         ) -> dict[str, Any]:
    return wire.AgentSpec("job", argv, cwd, (wire.RankStart(0, {}),),
                          watch=wire.Watch(beat, misses=2, grace=0.1),
                          pmi=wire.PmiSpec(mode="off")).to_json()


def test_the_agent_says_hello_with_its_protocol_version_first(head: Head) -> None:
    hello = head.next_frame()
    assert hello.kind is K.HELLO and hello.json()["protocol"] == wire.PROTOCOL_VERSION


def test_a_spec_whose_working_directory_is_missing_is_answered_with_an_error(
        head: Head) -> None:
    head.next_frame()
    head.send(K.SPEC, spec(cwd="/no/such/dir"))
    error = head.next_frame()
    assert error.kind is K.ERROR
    assert error.json()["what"] == "working directory missing"
    assert "/no/such/dir does not exist here" in error.json()["why"]


def test_a_spec_whose_program_is_not_found_is_answered_with_an_error(head: Head) -> None:
    head.next_frame()
    head.send(K.SPEC, spec(argv=("no-such-program-xyz",)))
    error = head.next_frame()
    assert error.kind is K.ERROR and error.json()["what"] == "program not found"


def test_a_spec_with_a_missing_field_is_answered_with_an_error_naming_it(head: Head) -> None:
    head.next_frame()
    body = spec()
    del body["cwd"]
    head.send(K.SPEC, body)
    error = head.next_frame()
    assert error.kind is K.ERROR and error.json()["what"] == "unreadable SPEC"
    assert "KeyError 'cwd'" in error.json()["why"]


def test_a_good_spec_is_answered_ready_and_bye_ends_the_agent_with_0(head: Head) -> None:
    head.next_frame()
    head.send(K.SPEC, spec())
    ready = head.next_frame()
    assert ready.kind is K.READY and ready.json()["ranks"] == 1
    head.send(K.BYE)
    assert head.result.get(timeout=5) == 0


def test_an_agent_whose_head_falls_silent_leaves_with_1(head: Head) -> None:
    head.next_frame()
    head.send(K.SPEC, spec(beat=0.05))  # silent for 2 x 0.05 s: the head is gone
    assert head.next_frame().kind is K.READY
    assert head.result.get(timeout=5) == 1


def test_an_agent_whose_head_falls_silent_says_so_before_it_leaves(head: Head) -> None:
    head.next_frame()
    head.send(K.SPEC, spec(beat=0.05))
    assert head.next_frame().kind is K.READY
    said = head.next_frame()
    assert said.kind is K.ERROR and said.json()["what"] == "the agent heard nothing from the head"
    assert "(limit 0.1s)" in said.json()["why"]
    assert head.result.get(timeout=5) == 1


def test_heartbeats_that_arrive_while_the_agents_loop_is_busy_are_not_silence(
        head: Head, monkeypatch: pytest.MonkeyPatch) -> None:
    # A starved agent's loop may come back to its frames late (64 agents and their ranks
    # starting on two cores): what arrived meanwhile was heard when it arrived.
    from launcher.agent import facts

    def slow_answer(query: dict[str, Any]) -> dict[str, Any]:
        time.sleep(2.5)  # the loop is held for 2.5 times the silence limit
        return {"op": "busy"}

    head.next_frame()
    head.send(K.SPEC, spec(beat=0.5))  # silent for 2 x 0.5 s: the head is gone
    assert head.next_frame().kind is K.READY
    monkeypatch.setattr(facts, "answer", slow_answer)
    stop = threading.Event()

    def beat() -> None:  # the head goes on beating meanwhile
        while not stop.wait(0.1):
            head.send(K.HEARTBEAT)

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        head.send(K.QUERY, {"op": "busy"})
        assert head.next_frame().kind is K.REPLY  # not ERROR: the head was heard all along
    finally:
        stop.set()
        beater.join()
    head.send(K.BYE)
    assert head.result.get(timeout=5) == 0


def test_a_pmi_message_reaches_the_pmi_thread_while_the_agents_loop_is_busy(
        head: Head, monkeypatch: pytest.MonkeyPatch) -> None:
    # Ranks waiting in a fence spin: its answer goes from the reader to the PMI thread
    # without waiting for the loop (here held by a slow query).
    from launcher.agent import facts

    def slow_answer(query: dict[str, Any]) -> dict[str, Any]:
        time.sleep(2.0)
        return {"op": "busy"}

    head.next_frame()
    body = spec()
    body["pmi"] = {**body["pmi"], "mode": "fd", "kvsname": "job", "world_size": 1}
    head.send(K.SPEC, body)
    assert head.next_frame().kind is K.READY
    monkeypatch.setattr(facts, "answer", slow_answer)
    head.send(K.QUERY, {"op": "busy"})
    head.send(K.PMI, {"op": "stall_query"})  # which ranks hold the barrier up?
    first = head.next_frame()
    assert first.kind is K.PMI and first.json()["op"] == "stall_state"  # before the REPLY
    assert head.next_frame().kind is K.REPLY
    head.send(K.BYE)
    assert head.result.get(timeout=5) == 0


def test_a_query_is_answered_and_an_unknown_one_gets_an_error_reply(head: Head) -> None:
    head.next_frame()
    head.send(K.QUERY, {"op": "free_port"})
    reply = head.next_frame()
    assert reply.kind is K.REPLY and 0 < reply.json()["port"] < 65536
    head.send(K.QUERY, {"op": "reboot"})
    assert head.next_frame().json()["error"] == "unknown query 'reboot'"


def test_the_head_closing_its_stream_without_bye_ends_an_idle_agent_with_1(head: Head) -> None:
    head.next_frame()
    head.to_agent.close()
    assert head.result.get(timeout=10) == 1


def test_a_program_the_kernel_cannot_execute_is_an_error_naming_the_rank(
        head: Head, tmp_path: Any) -> None:
    program = tmp_path / "garbage"
    program.write_bytes(b"\x00\x01 neither ELF nor #!")
    program.chmod(0o755)  # passes the spec check (an executable file), fails in execve
    head.next_frame()
    head.send(K.SPEC, spec(argv=(str(program),)))
    assert head.next_frame().kind is K.READY
    head.send(K.START, {"env": {}})
    error = head.next_frame()
    assert error.kind is K.ERROR
    assert error.json()["what"] == "rank did not start"
    assert error.json()["why"].startswith("rank 0: ") and "Exec format error" in error.json()["why"]


def test_the_agent_starts_without_typing_pathlib_secrets_or_dataclasses() -> None:
    # Every host pays the agent's imports before its ranks can start (`--timings`: boot);
    # the first three cost it ~15 ms of CPU and it needs none of them (type-only imports sit
    # behind TYPE_CHECKING, files are read with os, secrets only for PMI_PORT tokens);
    # `dataclasses` (with the `inspect` it imports) and its classes cost 26 of 68 ms: its
    # messages and the contract's records are `records.Record`s.
    code = ("import sys\n"
            "import launcher.agent.serve, launcher.agent.pmi_sockets, launcher.agent.progress\n"
            "print(sorted({'typing', 'pathlib', 'secrets', 'dataclasses', 'inspect'}\n"
            "             & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "[]"


class RecordingLink:
    """The agent's link to its head, recorded (no threads)."""

    def __init__(self, events: Any) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> bool:
        self.sent.append(data)
        return True

    def send_json(self, kind: wire.Kind, obj: dict[str, Any] | None = None) -> bool:
        return self.send(wire.encode_json(kind, obj))

    def take_on_arrival(self, take: Any) -> None:
        """Nothing arrives on a recorded link: no frame for ``take``."""


def test_each_ranks_environment_is_composed_from_one_copy_of_the_hosts_taken_at_the_spec(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`os.environ` decodes every variable on each walk: the agent copies it once a round
    (at the SPEC) and composes every rank's environment from the copy, scrubbed of other
    launchers' variables, with the planned ones on top."""
    monkeypatch.setenv("DTRAIN_TEST_HOST_VAR", "from-the-host")
    monkeypatch.setenv("PMI_RANK", "9")  # another launcher's: never a rank's
    agent = Agent(RecordingLink)  # type: ignore[arg-type]
    agent._on_spec(spec())
    assert wire.Decoder().feed(agent.link.sent[-1])[0].kind is K.READY  # type: ignore[attr-defined]
    monkeypatch.setattr(os, "environ", {})  # not read again for the ranks
    env = agent._rank_env(wire.RankStart(0, {"RANK": "0"}))
    assert env["DTRAIN_TEST_HOST_VAR"] == "from-the-host" and env["RANK"] == "0"
    assert "PMI_RANK" not in env


def test_an_idle_agent_sleeps_until_its_next_timer_not_a_second_at_most() -> None:
    to_agent_r, to_agent_w = os.pipe()
    from_agent_r, from_agent_w = os.pipe()
    try:
        agent = Agent(lambda events: HeadLink(events, lambda size: os.read(to_agent_r, size),
                                              os.fdopen(from_agent_w, "wb", buffering=0)))
        now = time.monotonic()
        agent.interval, agent.silence_limit = 30.0, 90.0
        agent.last_sent = agent.link.heard_at = now
        assert agent._wait_time(now) == pytest.approx(30.0)  # the next heartbeat
        agent.link.heard_at = now - 85.0
        assert agent._wait_time(now) == pytest.approx(5.0)  # the head's silence limit
        agent.kill_at = now + 2.0
        assert agent._wait_time(now) == pytest.approx(2.0)  # SIGKILL after the grace
        agent.leave_at = now + 0.5
        assert agent._wait_time(now) == pytest.approx(0.5)  # leaving after DONE
        agent.kill_at = agent.leave_at = None
        agent.link.heard_at = now - 100.0
        assert agent._wait_time(now) == 0.01  # overdue: the loop acts at once
    finally:
        os.close(to_agent_w)
        os.close(from_agent_r)
