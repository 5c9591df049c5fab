"""`--start eager` with in-memory agents: each host starts its ranks once it and rank 0's host
have checked the job, and a host that refuses or never answers stops the ranks already running.

A real `Supervisor` talks the real wire protocol to scripted agents (`tests.support.
scripted_agents`), as in `test_head_core`; the agents stamp when each frame reached them.
"""

from __future__ import annotations

import io
import signal
from collections.abc import Sequence

import pytest

from launcher import wire
from launcher.errors import AgentError
from launcher.head.options import SuperviseOptions
from launcher.head.outcome import JobOutcome
from launcher.head.supervisor import Supervisor
from launcher.hosts.hostfile import parse_host_list
from launcher.hosts.selection import select_hosts
from launcher.output.sink import OutputSink
from launcher.plan.job import make_plan
from tests.support.scripted_agents import MemoryAgentStream, Script, ScriptedAgent

BEAT = 0.05
EAGER = SuperviseOptions(heartbeat=BEAT, misses=20, grace=0.2, launch_timeout=10.0, pmi="off",
                         start="eager")
K = wire.Kind
SECRET = "hf_eager0123456789"


def run_job(scripts: Sequence[Script], opts: SuperviseOptions = EAGER
            ) -> tuple[JobOutcome, list[ScriptedAgent]]:
    """Two ranks per host, one scripted agent per host; the supervised job's outcome."""
    names = [f"node{i}" for i in range(len(scripts))]
    plan = make_plan(select_hosts(parse_host_list(",".join(f"{n}:2" for n in names))),
                     argv=["train"], cwd="/", job_id="job", base_env={"HF_TOKEN": SECRET})
    streams = [MemoryAgentStream(n) for n in names]
    agents = [ScriptedAgent(s, script, beat=BEAT) for s, script in zip(streams, scripts,
                                                                        strict=True)]
    sink = OutputSink({r.rank: r.host for r in plan.ranks}, io.BytesIO(), io.BytesIO())
    return Supervisor.over(streams, plan, sink, opts).run(("10.0.0.1", 29500)), agents


def _start_at(agent: ScriptedAgent) -> float:
    return agent.received_at[agent.received.index(K.START)]


def test_an_eager_job_runs_to_the_end_like_a_together_one() -> None:
    outcome, agents = run_job([Script({0: 0, 1: 0}), Script({2: 0, 3: 0})])
    assert outcome.exit_code == 0
    assert [r.state for r in outcome.ranks.values()] == ["exited"] * 4
    for agent in agents:
        assert [k for k in agent.received if k is not K.HEARTBEAT][:2] == [K.SPEC, K.START]


def test_a_host_starts_its_ranks_while_a_slower_host_is_still_booting() -> None:
    outcome, agents = run_job([Script({0: 0, 1: 0}), Script({2: 0, 3: 0}, boot_s=0.6)])
    assert outcome.exit_code == 0
    assert _start_at(agents[0]) < agents[1].hello_at


def test_the_same_hosts_start_together_without_eager() -> None:
    outcome, agents = run_job([Script({0: 0, 1: 0}), Script({2: 0, 3: 0}, boot_s=0.6)],
                              SuperviseOptions(heartbeat=BEAT, misses=20, grace=0.2, pmi="off"))
    assert outcome.exit_code == 0
    assert _start_at(agents[0]) > agents[1].hello_at


def test_no_host_starts_before_rank_0s_host_has_answered_with_the_rendezvous() -> None:
    outcome, agents = run_job([Script({0: 0, 1: 0}, boot_s=0.4), Script({2: 0, 3: 0})])
    assert outcome.exit_code == 0
    assert _start_at(agents[1]) > agents[0].hello_at


def test_a_host_refusing_the_job_stops_the_ranks_already_running_and_gets_no_secrets() -> None:
    outcome, agents = run_job([Script(), Script(refuse_spec=True, boot_s=0.3)])
    assert outcome.exit_code == 255
    assert outcome.failures[0].where == "host node1"
    assert "program not found" in outcome.failures[0].why
    assert agents[0].kills and agents[0].kills[0]["signal"] == signal.SIGTERM
    assert outcome.ranks[0].state == outcome.ranks[1].state == "stopped"
    assert outcome.ranks[2].state == outcome.ranks[3].state == "pending"
    assert K.START not in agents[1].received and K.BYE in agents[1].received
    assert not any(SECRET.encode() in f.payload for f in agents[1].frames)


def test_a_host_refusing_before_rank_0s_host_answers_starts_nothing_anywhere() -> None:
    with pytest.raises(AgentError, match=r"program not found \[host node1\]"):
        run_job([Script({0: 0, 1: 0}, boot_s=0.3), Script(refuse_spec=True)])


def test_a_host_that_never_answers_is_lost_at_the_launch_timeout_and_stops_the_others() -> None:
    opts = SuperviseOptions(heartbeat=BEAT, misses=20, grace=0.2, launch_timeout=0.5,
                            pmi="off", start="eager")
    outcome, agents = run_job([Script(), Script(mute=True)], opts)
    assert outcome.exit_code == 255
    assert outcome.failures[0].where == "host node1"
    assert "did not check the job within the launch timeout (0.5s)" in outcome.failures[0].why
    assert agents[0].kills and outcome.ranks[0].state == "stopped"
    assert K.START not in agents[1].received


def test_a_host_still_booting_when_the_job_gives_up_on_a_stuck_host_is_not_called_lost() -> None:
    # node0's rank 0 fails; its rank 1 takes 30 s to stop (past the head's patience, about
    # 5 s): node0 is lost. node1, still booting then, started nothing and is not lost.
    outcome, agents = run_job([Script({0: 7}, save_s=30.0), Script({2: 0, 3: 0}, boot_s=1.0)])
    assert outcome.exit_code == 7
    assert [f.where for f in outcome.failures] == ["rank 0@node0", "host node0"]
    assert "did not report its ranks stopped in time" in outcome.failures[1].why
    assert outcome.ranks[2].state == outcome.ranks[3].state == "pending"
    assert K.START not in agents[1].received and K.BYE in agents[1].received
