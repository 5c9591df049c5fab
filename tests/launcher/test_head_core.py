"""The head's core with in-memory agents: start-up, fail-fast, host loss, abort, exit codes.

A real `Supervisor` talks the real wire protocol to scripted agents over in-memory streams
(`tests.support.scripted_agents`): no sshd, no subprocess, a fraction of a second per test. What the
agents receive shows the order of the handshake (SPEC, START only once every host is READY,
KILL on failure, BYE at the end).
"""

from __future__ import annotations

import dataclasses
import io
import random
import signal
import threading
import time
from collections.abc import Sequence

import pytest

from launcher import wire
from launcher.errors import AgentError
from launcher.head.options import SuperviseOptions
from launcher.head.outcome import Failure, JobOutcome, RankOutcome
from launcher.head.supervisor import Supervisor
from launcher.hosts.hostfile import parse_host_list
from launcher.hosts.selection import select_hosts
from launcher.output.sink import OutputSink
from launcher.plan.job import make_plan
from tests.support.scripted_agents import MemoryAgentStream, Script, ScriptedAgent

BEAT = 0.05  # seconds between heartbeats; a host silent for 20 of them (1 s) is lost
OPTS = SuperviseOptions(heartbeat=BEAT, misses=20, grace=0.2, launch_timeout=10.0, pmi="off")
K = wire.Kind
# A PATH too large for a pipe even compressed (`launcher.wire.COMPRESS_FROM`): random text.
LARGE_PATH = random.Random(7).randbytes(60_000).hex()


def run_job(scripts: Sequence[Script], base_env: dict[str, str] | None = None,
            agents: list[ScriptedAgent] | None = None) -> tuple[JobOutcome, list[ScriptedAgent]]:
    """Two ranks per host, one scripted agent per host (added to ``agents`` as they start);
    the supervised job's outcome."""
    names = [f"node{i}" for i in range(len(scripts))]
    selected = select_hosts(parse_host_list(",".join(f"{n}:2" for n in names)))

    plan = make_plan(selected, argv=["train"], cwd="/", job_id="job", base_env=base_env or {})
    streams = [MemoryAgentStream(n) for n in names]
    agents = [] if agents is None else agents
    agents += [ScriptedAgent(s, script, beat=BEAT) for s, script in zip(streams, scripts,
                                                                          strict=True)]

    sink = OutputSink({r.rank: r.host for r in plan.ranks}, io.BytesIO(), io.BytesIO())
    outcome = Supervisor.over(streams, plan, sink, OPTS).run(("10.0.0.1", 29500))
    return outcome, agents


def test_a_job_whose_ranks_all_exit_0_goes_spec_start_bye_and_exits_0() -> None:
    outcome, agents = run_job([Script({0: 0, 1: 0}), Script({2: 0, 3: 0})])
    assert outcome.exit_code == 0
    assert [r.state for r in outcome.ranks.values()] == ["exited"] * 4
    for agent in agents:
        kinds = [k for k in agent.received if k is not K.HEARTBEAT]
        assert kinds[:2] == [K.SPEC, K.START] and K.BYE in kinds and K.KILL not in kinds


def _frames_to_an_agent_that_never_starts(base_env: dict[str, str]) -> list[wire.Kind]:
    """What the head writes to a host whose agent never says anything, until the launch
    timeout gives up on it."""
    plan = make_plan(select_hosts(parse_host_list("node0:2")), argv=["train"], cwd="/",
                     job_id="job", base_env=base_env)
    stream = MemoryAgentStream("node0")
    stream.finished.set()  # nothing to wait for once the head gives up
    sink = OutputSink({r.rank: r.host for r in plan.ranks}, io.BytesIO(), io.BytesIO())
    with pytest.raises(AgentError, match=r"did not check the job in time .*"
                                         r"not started yet: node0\. .*--launch-timeout"):
        Supervisor.over([stream], plan, sink, dataclasses.replace(OPTS, launch_timeout=0.5)).run(
            ("10.0.0.1", 29500))
    decoder, kinds = wire.Decoder(), []
    while data := stream.to_agent.read(1 << 20):
        kinds += [frame.kind for frame in decoder.feed(data)]
    return kinds


def test_the_spec_is_waiting_in_the_stream_before_the_agent_says_hello() -> None:
    assert _frames_to_an_agent_that_never_starts({}) == [K.SPEC, K.BYE]


def test_a_spec_too_large_for_a_pipe_waits_for_the_agents_hello() -> None:
    # Written at once it could block the head on a pipe nobody reads yet (a SPEC holds the
    # PATH its agent checks the program with; random, so that it stays large compressed).
    assert _frames_to_an_agent_that_never_starts({"PATH": LARGE_PATH}) == [K.BYE]


def test_a_job_whose_specs_are_too_large_for_a_pipe_starts_once_its_agents_say_hello() -> None:
    outcome, agents = run_job([Script({0: 0, 1: 0}), Script({2: 0, 3: 0})],
                              base_env={"PATH": LARGE_PATH})
    assert outcome.exit_code == 0
    assert all([k for k in a.received if k is not K.HEARTBEAT][:2] == [K.SPEC, K.START]
               for a in agents)


def test_an_agent_that_boots_for_longer_than_the_silence_limit_still_starts_its_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # An agent cannot beat before its HELLO (its shell, Python and imports: 15 s and more
    # when 64 agents and their ranks start on two cores); the launch timeout bounds it.
    # The agents' default before their SPEC: 1 s of silence.
    class QuickWatch(wire.Watch, frozen=True):
        heartbeat: float = BEAT
        misses: int = 20

    monkeypatch.setattr(wire, "Watch", QuickWatch)
    outcome, _ = run_job([Script({0: 0, 1: 0}), Script({2: 0, 3: 0}, boot_s=1.5)])
    assert outcome.exit_code == 0, outcome.failures


def test_a_host_that_starts_no_ranks_because_another_refused_never_gets_the_secrets() -> None:
    secret = "hf_head0123456789"
    agents: list[ScriptedAgent] = []
    with pytest.raises(AgentError, match=r"program not found \[host node1\]"):
        run_job([Script({0: 0, 1: 0}), Script(refuse_spec=True)],
                base_env={"PATH": "/venv/bin", "HF_TOKEN": secret}, agents=agents)
    first = agents[0]
    assert [f.kind for f in first.frames if f.kind is not K.HEARTBEAT] == [K.SPEC, K.BYE]
    assert first.specs[0]["check_env"] == {"PATH": "/venv/bin"}
    assert not any(secret.encode() in f.payload for f in first.frames)


def test_a_host_refusing_its_spec_starts_nothing_on_any_host() -> None:
    with pytest.raises(AgentError, match=r"program not found \[host node1\]"):
        run_job([Script({0: 0, 1: 0}), Script(refuse_spec=True)])


def test_a_rank_exiting_7_stops_every_other_host_and_the_job_exits_7() -> None:
    outcome, agents = run_job([Script({}), Script({3: 7})])
    assert outcome.exit_code == 7
    assert outcome.failures[0].where == "rank 3@node1"
    assert agents[0].kills and agents[0].kills[0]["signal"] == signal.SIGTERM
    assert outcome.ranks[0].state == outcome.ranks[1].state == "stopped"


def test_a_host_that_falls_silent_is_lost_with_255_and_the_others_are_stopped() -> None:
    outcome, agents = run_job([Script({}), Script(silent_after_start=True)])
    assert outcome.exit_code == 255
    assert outcome.failures[0].where == "host node1"
    assert "no heartbeat" in outcome.failures[0].why
    assert agents[0].kills
    assert {outcome.ranks[2].state, outcome.ranks[3].state} == {"lost"}


def test_an_mpi_abort_ends_the_job_with_its_code_everywhere() -> None:
    outcome, agents = run_job([Script({}, abort=(1, 42)), Script({})])
    assert outcome.exit_code == 42
    assert outcome.abort is not None and outcome.abort.where == "rank 1@node0"
    assert all(agent.kills for agent in agents)


def test_a_sigterm_to_the_head_while_a_rank_failure_stops_the_job_keeps_the_grace() -> None:
    # scancel, preemption, a pod's end: SIGTERM reaches the ranks and the head alike. Rank 0
    # has saved and exited 143 first; the others are still saving when the head's own comes.
    agents: list[ScriptedAgent] = []
    streams: list[MemoryAgentStream] = []
    plan = make_plan(select_hosts(parse_host_list("node0:2,node1:2")), argv=["train"], cwd="/",
                     job_id="job", base_env={})
    for name, script in (("node0", Script({0: 143}, save_s=1.0)), ("node1", Script(save_s=1.0))):
        streams.append(MemoryAgentStream(name))
        agents.append(ScriptedAgent(streams[-1], script, beat=BEAT))
    sink = OutputSink({r.rank: r.host for r in plan.ranks}, io.BytesIO(), io.BytesIO())
    sup = Supervisor.over(streams, plan, sink, OPTS)

    def sigterm_once_stopping() -> None:
        while not all(agent.kills for agent in agents):
            time.sleep(0.01)
        sup.on_signal(signal.SIGTERM)
    threading.Thread(target=sigterm_once_stopping, daemon=True).start()
    outcome = sup.run(("10.0.0.1", 29500))
    assert outcome.exit_code == 143 and outcome.summary == "interrupted by SIGTERM"
    assert [k["signal"] for agent in agents for k in agent.kills] == [signal.SIGTERM] * 2
    assert outcome.failures[0].why == "exited with code 143 (128 + SIGTERM, not sent by dtrain)"
    assert [outcome.ranks[r].describe() for r in range(4)] == (
        ["exit 143"] + ["exit 143 after dtrain's SIGTERM"] * 3)


@pytest.mark.parametrize("rank, says", [
    (RankOutcome(0, "h", "stopped", 137, signal.SIGKILL, sent=((15, 0.0), (9, 10.0))),
     "killed by SIGKILL from dtrain, 10.0s after its SIGTERM"),
    (RankOutcome(0, "h", "stopped", 143, signal.SIGTERM, sent=((15, 0.0),)),
     "killed by SIGTERM from dtrain"),
    (RankOutcome(0, "h", "stopped", 143, None, sent=((15, 0.0),)),
     "exit 143 after dtrain's SIGTERM"),
    (RankOutcome(0, "h", "stopped", 130, None, sent=((2, 0.0), (9, 0.5))),
     "exit 130 after dtrain's SIGINT"),
    (RankOutcome(0, "h", "exited", 137, signal.SIGKILL), "killed by SIGKILL (not sent by dtrain)"),
    (RankOutcome(0, "h", "stopped", 137, signal.SIGKILL, sent=((15, 0.0),)),
     "killed by SIGKILL (not sent by dtrain)"),
    (RankOutcome(0, "h", "exited", 139, signal.SIGSEGV), "killed by SIGSEGV"),
    (RankOutcome(0, "h", "exited", 143), "exit 143"),
], ids=["grace-ran-out", "dtrain-sigterm", "saved-and-exited", "ctrl-c", "oom-killer",
        "killed-while-stopping", "crash", "own-exit"])
def test_a_ranks_status_says_who_signalled_it(rank: RankOutcome, says: str) -> None:
    assert rank.describe() == says


def ranks(*codes: int | None) -> dict[int, RankOutcome]:
    return {r: RankOutcome(r, "h", "exited", code) for r, code in enumerate(codes)}


@pytest.mark.parametrize("outcome,code", [
    (JobOutcome(ranks(0, 0)), 0),
    (JobOutcome(ranks(0, 3), failures=[Failure(3, "rank 1@h", "exit 3")]), 3),
    (JobOutcome(ranks(0, 137), failures=[Failure(137, "rank 1@h", "SIGKILL")]), 137),
    (JobOutcome(ranks(0, 1), abort=Failure(42, "rank 0@h", "MPI_Abort"),
                failures=[Failure(1, "rank 1@h", "exit 1")]), 42),
    (JobOutcome(ranks(0, 143), timed_out=True,
                abort=Failure(42, "rank 0@h", "MPI_Abort")), 124),
    (JobOutcome(ranks(0, 143), interrupted_by=signal.SIGINT, timed_out=True), 130),
    (JobOutcome(ranks(0, 143), interrupted_by=signal.SIGTERM), 143),
    (JobOutcome(ranks(0, 143), interrupted_by=signal.SIGHUP), 129),
], ids=["success", "first-failure", "signal", "abort-over-failure", "timeout-over-abort",
        "ctrl-c-first", "sigterm", "sighup"])
def test_the_exit_code_rule_first_match_wins(outcome: JobOutcome, code: int) -> None:
    assert outcome.exit_code == code


def test_a_sigkilled_rank_whose_pmi_close_came_first_is_its_signal_not_1() -> None:
    outcome = JobOutcome({0: RankOutcome(0, "h", "running"), 1: RankOutcome(1, "h", "running")})
    outcome.record_failure(Failure(1, "rank 1@h", "closed its PMI connection", 1, inferred=True))
    assert outcome.rank_exited(0, 143, signal.SIGTERM, stopping=True) is None
    assert outcome.rank_exited(1, 137, signal.SIGKILL, stopping=True) is None
    assert outcome.exit_code == 137
    assert outcome.failures[0].why.startswith("killed by SIGKILL")
    assert [outcome.ranks[r].state for r in (0, 1)] == ["stopped", "exited"]


def test_a_rank_that_closed_pmi_and_then_exited_0_still_fails_with_1() -> None:
    outcome = JobOutcome({0: RankOutcome(0, "h", "running")})
    outcome.record_failure(Failure(1, "rank 0@h", "closed its PMI connection", 0, inferred=True))
    outcome.rank_exited(0, 0, None, stopping=True)
    assert (outcome.exit_code, outcome.failures[0].why) == (1, "closed its PMI connection")


def test_frames_decode_the_same_whatever_the_chunking() -> None:
    frames = [wire.encode_json(K.HELLO, {"protocol": 2}), wire.encode_output(3, 2, b"x\r\ny"),
              wire.encode(K.HEARTBEAT), wire.encode_json(K.EXIT, {"rank": 3, "code": 0})]
    data = b"".join(frames)
    decoder, got = wire.Decoder(), []
    for i in range(len(data)):  # one byte at a time: the worst chunking a stream can give
        got.extend(decoder.feed(data[i:i + 1]))
    assert [f.kind for f in got] == [K.HELLO, K.OUTPUT, K.HEARTBEAT, K.EXIT]
    out = wire.decode_output(got[1])
    assert (out.rank, out.stream, out.data) == (3, 2, b"x\r\ny")
    assert got[3].json() == {"rank": 3, "code": 0}


def test_an_oversized_frame_is_a_wire_error_not_an_allocation() -> None:
    header = (wire.MAX_FRAME + 1).to_bytes(4, "big") + bytes([K.OUTPUT])
    with pytest.raises(wire.WireError):
        list(wire.Decoder().feed(header))


def test_the_heads_periodic_checks_are_due_at_once_then_at_most_once_per_period():
    from launcher.head.startup import Every

    checks = Every(0.25)  # binary fractions: the sums below are exact
    assert checks.due(100.0)
    assert not checks.due(100.125)
    assert checks.due(100.25)
    assert [checks.due(100.25 + t) for t in (0.0625, 0.125, 0.375)] == [False, False, True]
@pytest.mark.parametrize("rounds", [False, True])
def test_a_host_done_leaves_at_once_while_others_run_unless_a_round_may_follow(
        rounds: bool) -> None:
    """As `launcher.restart.rounds` runs a job (``keep_agents``: the caller dismisses the
    agents at the end): a host whose ranks are all done gets BYE and its stream's end at once
    when no round can follow, so the agents leave while the others finish, not all together
    after the last; with rounds it stays, its agent kept for the next."""
    from launcher.head.agent_link import Fleet

    names = ["node0", "node1"]
    selected = select_hosts(parse_host_list(",".join(f"{n}:2" for n in names)))
    plan = make_plan(selected, argv=["train"], cwd="/", job_id="job", base_env={})
    streams = [MemoryAgentStream(n) for n in names]
    # node1's rank 3 runs on until the job's --timeout stops it.
    agents = [ScriptedAgent(s, script, beat=BEAT)
              for s, script in zip(streams, [Script({0: 0, 1: 0}), Script({2: 0})],
                                   strict=True)]
    fleet = Fleet()
    links = [fleet.add(s) for s in streams]
    sink = OutputSink({r.rank: r.host for r in plan.ranks}, io.BytesIO(), io.BytesIO())
    opts = dataclasses.replace(OPTS, timeout=1.0, rounds=rounds)
    seen: list[bool] = []  # when node0's agent left: was node1 stopped yet?

    def watch() -> None:
        if streams[0].finished.wait(5.0):
            seen.append(bool(agents[1].kills))

    watcher = threading.Thread(target=watch)
    watcher.start()
    outcome = Supervisor(fleet, links, plan, sink, opts, keep_agents=True).run(
        ("10.0.0.1", 29500))
    assert outcome.timed_out
    done, running = agents
    assert done.kills == [] and running.kills
    if rounds:  # both kept for the next round: the caller dismisses them
        assert K.BYE not in done.received and K.BYE not in running.received
        assert links[0].alive and links[1].alive
    else:  # each left at its DONE, node0 long before node1 was stopped
        # node1's BYE went out as the head's loop ended; its agent reads it on its own
        # thread, which a loaded machine may run after `run` returned (CI once saw that).
        assert all(stream.finished.wait(5.0) for stream in streams)
        assert K.BYE in done.received and K.BYE in running.received
        assert not links[0].alive and not links[1].alive  # EOF after BYE
    fleet.dismiss(fleet.links, wait=1.0)
    watcher.join()
    assert seen == [rounds]  # without rounds node0 left before node1 was stopped
    assert done.received.count(K.BYE) == running.received.count(K.BYE) == 1
