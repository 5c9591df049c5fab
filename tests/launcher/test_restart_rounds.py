"""Restart rounds on the head's core with in-memory agents (`tests.support.scripted_agents`).

Real `Rounds` and `Supervisor` objects speak the real wire protocol to scripted agents: what
each agent receives shows the rounds (SPEC, START, KILL, a second SPEC on the same stream, BYE
at the end), which host a spare replaced, and that every agent is dismissed however the job
ends. A fraction of a second per test.
"""

from __future__ import annotations

import dataclasses
import io
import signal
import threading
import time
from collections.abc import Sequence

import pytest

from launcher import wire
from launcher.errors import ConnectError
from launcher.head.options import SuperviseOptions
from launcher.hosts.hostfile import parse_hostfile_text
from launcher.hosts.selection import HostSlots, select_hosts
from launcher.output.sink import OutputSink
from launcher.plan.job import JobPlan
from launcher.restart.policy import RestartOptions
from launcher.restart.pool import split_spares
from launcher.restart.rounds import JobEnd, Rounds, RoundsSetup
from tests.support.scripted_agents import MemoryAgentStream, Script, ScriptedAgent

BEAT = 0.05
OPTS = SuperviseOptions(heartbeat=BEAT, misses=20, grace=0.2, launch_timeout=10.0, pmi="off",
                        rounds=True)
K = wire.Kind
OK = Script({r: 0 for r in range(4)})  # whichever of these ranks the host runs exits 0
SECRET = "hf_scripted0123456789"  # a forwarded HF_TOKEN: only hosts that start ranks get it
BASE_ENV = {"PATH": "/venv/bin", "VIRTUAL_ENV": "/venv", "HF_TOKEN": SECRET}


class Cluster:
    """One scripted agent per host, started when the head connects to it (``again``: the
    scripts of an agent started when the head connects to a host once more)."""

    def __init__(self, scripts: dict[str, Sequence[Script]],
                 again: dict[str, Sequence[Script]] | None = None) -> None:
        self.scripts, self.again = scripts, again or {}
        self.agents: dict[str, list[ScriptedAgent]] = {}
        self.stderr: list[io.BytesIO] = []  # each round's sink's stderr (the head's notices)
        self.down: set[str] = set()  # hosts that cannot be connected to again

    def sink_for(self, plan: JobPlan, folder: object) -> OutputSink:
        self.stderr.append(io.BytesIO())
        return OutputSink({r.rank: r.host for r in plan.ranks}, io.BytesIO(), self.stderr[-1])

    def said(self, capsys: pytest.CaptureFixture[str]) -> str:
        """What the head said on stderr: between rounds directly, during one in its sink."""
        return capsys.readouterr().err + b"".join(s.getvalue() for s in self.stderr).decode()

    def connect(self, hosts: Sequence[HostSlots]) -> list[MemoryAgentStream | ConnectError]:
        streams: list[MemoryAgentStream | ConnectError] = []
        for host in hosts:
            name = host.entry.name
            if name in self.down and name in self.agents:
                streams.append(ConnectError("cannot connect", f"host {name}", "down", ""))
                continue
            stream = MemoryAgentStream(name)
            scripts = self.again if name in self.agents else self.scripts
            first, *later = scripts.get(name, [OK])
            self.agents.setdefault(name, []).append(
                ScriptedAgent(stream, first, beat=BEAT, later=tuple(later)))
            streams.append(stream)
        return streams

    def received(self, host: str) -> list[wire.Kind]:
        return [k for a in self.agents[host] for k in a.received if k is not K.HEARTBEAT]


def run_job(hostfile: str, scripts: dict[str, Sequence[Script]], restart: RestartOptions,
            on_start: object = None, opts: SuperviseOptions = OPTS) -> tuple[JobEnd, Cluster]:
    cluster = Cluster(scripts)
    active, spares = split_spares(select_hosts(parse_hostfile_text(hostfile, "hf")),
                                  restart.spares)
    setup = RoundsSetup(
        argv=("train",), cwd="/", job_id="job", base_env=BASE_ENV, supervise=opts,
        restart=restart,
        master=("10.0.0.1", 29500), log_dir=None, connect=cluster.connect,  # type: ignore
        sink_for=cluster.sink_for)
    rounds = Rounds(setup, active, spares)
    hosts = [*active, *spares]
    rounds.adopt(hosts, cluster.connect(hosts))
    if callable(on_start):
        on_start(rounds)
    return rounds.run(time.monotonic()), cluster


def spec_ranks(agent: ScriptedAgent) -> list[list[int]]:
    return [[r["rank"] for r in spec["ranks"]] for spec in agent.specs]


def test_a_crashed_rank_restarts_the_job_on_the_same_hosts_over_the_same_streams():
    end, cluster = run_job("node1\nnode2\n", {"node2": [Script({1: 137}), OK]},
                           RestartOptions(max_restarts=2, backoff=0))
    assert end.outcome.exit_code == 0 and end.why == ""
    assert [r.exit_code for r in end.records] == [137, 0]
    assert end.records[0].cause == "rank exited 137" and end.records[0].blamed == ("node2",)
    for host in ("node1", "node2"):
        [agent] = cluster.agents[host]  # one connection for the whole job
        assert cluster.received(host).count(K.SPEC) == 2 and cluster.received(host)[-1] is K.BYE
    env = cluster.agents["node1"][0].specs[1]["ranks"][0]["env"]
    assert (env["DTRAIN_RESTART_COUNT"], env["TORCHELASTIC_RESTART_COUNT"],
            env["TORCHELASTIC_MAX_RESTARTS"], env["DTRAIN_RESTART_CAUSE"]) == (
        "1", "1", "2", "rank exited 137: node2")


@pytest.mark.parametrize("second", [OK, Script(refuse_spec=True)], ids=["ready", "refused"])
def test_an_eager_round_that_fails_while_a_host_boots_waits_for_its_answer_before_the_next(
        second: Script) -> None:
    # node1's rank fails at once; node2 is still booting with the first round's SPEC waiting.
    # Its READY to that SPEC must end its part of the first round, not count for the second:
    # node2 starts in the second round only once it has checked that round's SPEC.
    end, cluster = run_job("node1\nnode2\n", {"node1": [Script({0: 137}), OK],
                                              "node2": [Script(boot_s=0.5), second]},
                           RestartOptions(max_restarts=1, backoff=0),
                           opts=dataclasses.replace(OPTS, start="eager"))
    assert end.records[0].exit_code == 137
    got = [k for k in cluster.received("node2") if k is not K.KILL]
    if second.refuse_spec:
        assert end.outcome.exit_code == 255 and K.START not in got
    else:
        assert end.outcome.exit_code == 0 and end.records[1].exit_code == 0
        assert got[:3] == [K.SPEC, K.SPEC, K.START] and got.count(K.START) == 1
    assert cluster.received("node2")[-1] is K.BYE


def test_a_lost_host_is_replaced_by_the_spare_in_its_place():
    cut = Script(silent_after_start=True)
    end, cluster = run_job("node1\nnode2\nnode3\nnode4 spare\n", {"node2": [cut]},
                           RestartOptions(max_restarts=1, backoff=0))
    assert end.outcome.exit_code == 0
    assert end.records[0].cause == "host lost" and end.records[0].change == "node4 replaces node2"
    spare = cluster.agents["node4"][0]
    assert spec_ranks(spare) == [[], [1]]  # a check of the job first, then rank 1's place
    # of the job's forwarded variables only those that find its program; no PMI, no progress
    assert spare.specs[0]["check_env"] == {"PATH": "/venv/bin", "VIRTUAL_ENV": "/venv"}
    assert spare.specs[0]["pmi"]["mode"] == "off" and "progress" not in spare.specs[0]
    assert [h for h, _ in end.last.outcome.ranks.items()] == [0, 1, 2]
    assert {r.host for r in end.last.outcome.ranks.values()} == {"node1", "node4", "node3"}


def _carries_secret(frame: wire.Frame) -> bool:
    return SECRET.encode() in frame.payload


def test_secrets_reach_a_host_only_with_the_start_of_its_ranks_never_a_spare_that_runs_none():
    end, cluster = run_job("node1\nnode2\nnode3 spare\n", {}, RestartOptions(max_restarts=1))
    assert end.outcome.exit_code == 0
    [spare] = cluster.agents["node3"]
    assert spare.frames and not any(_carries_secret(f) for f in spare.frames)
    for host in ("node1", "node2"):  # the SPEC holds none; START brings them for the ranks
        [agent] = cluster.agents[host]
        assert [f.kind for f in agent.frames if _carries_secret(f)] == [K.START]
        assert agent.frames[agent.received.index(K.START)].json()["base"] == BASE_ENV


def test_a_spare_vetted_by_restart_check_gets_secrets_only_when_it_starts_its_ranks():
    cut = Script(silent_after_start=True)
    end, cluster = run_job("node1\nnode2\nnode3 spare\n", {"node2": [cut]},
                           RestartOptions(max_restarts=1, backoff=0, restart_check=True))
    assert end.outcome.exit_code == 0 and end.records[0].change == "node3 replaces node2"
    [spare] = cluster.agents["node3"]
    query = next(f for f in spare.frames if f.kind is K.QUERY)
    assert query.json()["env"] == {"PATH": "/venv/bin", "VIRTUAL_ENV": "/venv"}
    assert [f.kind for f in spare.frames if _carries_secret(f)] == [K.START]


CUT_LATER = Script(silent_at=2.5)  # node2's cable is cut 2.5 s into the round


def test_a_spare_slow_to_boot_is_held_to_a_starting_hosts_limit_and_takes_the_place(capsys):
    # 1.5 s before its HELLO: longer than the job's silence limit (1 s), well within what a
    # host starting ranks is allowed while its agent boots
    end, cluster = run_job("node1\nnode2\nnode3 spare\n",
                           {"node2": [CUT_LATER], "node3": [Script({1: 0}, boot_s=1.5)]},
                           RestartOptions(max_restarts=1, backoff=0))
    assert end.outcome.exit_code == 0 and end.records[0].change == "node3 replaces node2"
    assert len(cluster.agents["node3"]) == 1  # its first agent, never dropped
    assert "spare node3" not in cluster.said(capsys)


def test_a_spare_that_falls_silent_is_said_lost_once_and_connected_again_for_its_place(capsys):
    end, cluster = run_job("node1\nnode2\nnode3 spare\n",
                           {"node2": [CUT_LATER], "node3": [Script(silent_after_ready=True)]},
                           RestartOptions(max_restarts=1, backoff=0))
    assert end.outcome.exit_code == 0 and end.records[0].change == "node3 replaces node2"
    assert len(cluster.agents["node3"]) == 2  # connected again before it took the place
    err = cluster.said(capsys)
    lost = [line for line in err.splitlines() if "spare node3 lost" in line]
    assert lost == [lost[0]] and "no heartbeat for 1." in lost[0]
    assert err.count("dtrain: spare node3 is back (connected again)\n") == 1
    assert "spare node3 lost" in cluster.stderr[0].getvalue().decode()  # said during round 0


def test_a_spare_not_reached_at_start_is_tried_again_before_the_job_gives_up(capsys):
    cluster = Cluster({"node2": [CUT_LATER]})
    active, spares = split_spares(select_hosts(parse_hostfile_text(
        "node1\nnode2\nnode3 spare\n", "hf")), 0)
    setup = RoundsSetup(
        argv=("train",), cwd="/", job_id="job", base_env=BASE_ENV, supervise=OPTS,
        restart=RestartOptions(max_restarts=1, backoff=0), master=("10.0.0.1", 29500),
        log_dir=None, connect=cluster.connect,  # type: ignore
        sink_for=cluster.sink_for)
    rounds = Rounds(setup, active, spares)
    down = ConnectError("cannot connect", "host node3", "connection refused", "")
    rounds.adopt([*active, *spares], [*cluster.connect(active), down])
    end = rounds.run(time.monotonic())
    assert end.outcome.exit_code == 0 and end.records[0].change == "node3 replaces node2"
    err = cluster.said(capsys)
    assert err.count("spare node3 not reached") == 1 and err.count("spare node3 is back") == 1


def test_without_exclusion_hosts_that_cannot_be_reached_again_end_the_job_not_loop_forever():
    cluster = Cluster({"node2": [CUT_LATER], "node3": [Script(silent_after_ready=True)]})
    cluster.down = {"node2", "node3"}  # neither the cut host nor the spare comes back
    active, spares = split_spares(select_hosts(parse_hostfile_text(
        "node1\nnode2\nnode3 spare\n", "hf")), 0)
    setup = RoundsSetup(
        argv=("train",), cwd="/", job_id="job", base_env=BASE_ENV, supervise=OPTS,
        restart=RestartOptions(max_restarts=1, backoff=0, exclude_after=0),
        master=("10.0.0.1", 29500), log_dir=None, connect=cluster.connect,  # type: ignore
        sink_for=cluster.sink_for)
    rounds = Rounds(setup, active, spares)
    rounds.adopt([*active, *spares], cluster.connect([*active, *spares]))
    end = rounds.run(time.monotonic())
    assert end.outcome.exit_code == 255 and len(end.records) == 1
    assert end.why.startswith("host node") and "cannot be reached again" in end.why


def test_a_bad_flag_exit_2_is_never_restarted():
    end, cluster = run_job("node1\nnode2\n", {"node1": [Script({0: 2})]},
                           RestartOptions(max_restarts=3, backoff=0))
    assert end.outcome.exit_code == 2 and len(end.records) == 1
    assert "exit code 2 is permanent (--no-restart-on 2)" in end.why
    assert all(cluster.received(h)[-1] is K.BYE for h in ("node1", "node2"))


def test_a_spent_budget_ends_with_the_last_failures_code():
    end, _ = run_job("node1\nnode2\nnode3\n", {"node1": [Script({0: 5}), OK, OK],
                                               "node2": [OK, Script({1: 7}), OK]},
                     RestartOptions(max_restarts=1, backoff=0))
    assert end.outcome.exit_code == 7
    assert [r.exit_code for r in end.records] == [5, 7]
    assert "the restart budget is spent (1 of --max-restarts 1)" in end.why


def test_without_a_spare_min_nodes_goes_on_with_the_hosts_left():
    cut = Script(silent_after_start=True)
    end, cluster = run_job("node1\nnode2\nnode3\n", {"node2": [cut]},
                           RestartOptions(max_restarts=1, backoff=0, min_nodes=2))
    assert end.outcome.exit_code == 0
    assert spec_ranks(cluster.agents["node3"][0]) == [[2], [1]]  # renumbered: world 2
    env = cluster.agents["node3"][0].specs[1]["ranks"][0]["env"]
    assert (env["WORLD_SIZE"], env["DTRAIN_INITIAL_WORLD_SIZE"]) == ("2", "3")


def _interrupt_when(ready) -> object:
    """An ``on_start`` that sends the head Ctrl-C once ``ready(rounds)`` holds."""
    def on_start(rounds: Rounds) -> None:
        def later() -> None:
            while not ready(rounds):
                time.sleep(0.01)
            rounds.on_signal(signal.SIGINT)
        threading.Thread(target=later, daemon=True).start()
    return on_start


def test_ctrl_c_during_the_back_off_ends_the_job_with_130_and_dismisses_every_agent():
    t0 = time.monotonic()
    end, cluster = run_job("node1\nnode2\nnode3 spare\n", {"node1": [Script({0: 9})]},
                           RestartOptions(max_restarts=3, backoff=30), on_start=_interrupt_when(
                               lambda r: len(r.records) == 1 and r.current is None))
    assert end.outcome.exit_code == 130 and time.monotonic() - t0 < 10
    assert len(end.records) == 1
    assert all(cluster.received(h)[-1] is K.BYE for h in ("node1", "node2", "node3"))


def test_ctrl_c_while_a_restart_starts_ends_the_job_with_130_and_dismisses_every_agent():
    stuck = Script(mute=True)  # the second round's agent never answers its SPEC
    end, cluster = run_job("node1\nnode2\n", {"node1": [Script({0: 9}), stuck]},
                           RestartOptions(max_restarts=3, backoff=0), on_start=_interrupt_when(
                               lambda r: len(r.records) == 2 and r.current is not None))
    assert end.outcome.exit_code == 130 and len(end.records) == 2
    assert all(cluster.received(h)[-1] is K.BYE for h in ("node1", "node2"))
    assert K.START not in cluster.received("node1")[2:]  # the second round started nothing


def test_restarts_under_mpirun_and_spares_without_restarts_are_refused_once(tmp_path):
    from tests.support import PYTHON, run_dtrain

    res = run_dtrain(["launch", "--launcher", "mpirun", "--max-restarts", "2", "--", PYTHON,
                      "-c", "pass"])
    assert res.returncode == 2 and res.stderr.count("error:") == 1
    assert "restarts are not supported with --launcher mpirun [--max-restarts]" in res.stderr
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1 spare\n")
    res = run_dtrain(["launch", "-f", str(hostfile), "--", PYTHON, "-c", "pass"])
    assert res.returncode == 2
    assert f"spare hosts and --min-nodes need restarts [{hostfile}:2]" in res.stderr
    assert "Add --max-restarts N" in res.stderr
    res = run_dtrain(["launch", "--no-restart-on", "2,x", "--", PYTHON, "-c", "pass"])
    assert res.returncode == 2 and "'x' is not an exit code" in res.stderr
