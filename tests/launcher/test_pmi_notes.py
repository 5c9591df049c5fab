"""What dtrain tells the user about PMI: refused MPI features once, stalled barriers once per
interval naming only the ranks they wait for (pure cores, then real MPICH ranks)."""

from __future__ import annotations

import re

import pytest

from launcher.head.pmi_notes import PmiNotes
from launcher.pmi.proxy import PmiProxy
from launcher.pmi.stall import StallClock
from tests.support import PYTHON, run_dtrain

# ----- pure cores ----------------------------------------------------------------------------


def test_the_stall_clock_fires_once_per_interval_and_restarts_for_a_new_barrier():
    clock = StallClock(10.0)
    seen = [t for t in range(0, 35) if clock.due(float(t), "epoch-0") is not None]
    assert seen == [10, 20, 30]
    assert clock.due(35.0, "epoch-1") is None      # a new barrier starts the count again
    assert clock.due(44.0, "epoch-1") is None
    assert clock.due(45.0, "epoch-1") == 10.0
    assert clock.due(46.0, None) is None           # nothing stalled: reset
    assert clock.due(50.0, "epoch-1") is None


def test_a_partly_entered_barrier_names_only_the_ranks_outside_it():
    proxy = PmiProxy(ranks=[4, 5, 6], world_size=8, kvsname="k", process_mapping="")
    for conn, rank in ((1, 4), (2, 5), (3, 6)):
        proxy.open(conn, rank)
    assert proxy.holding_up() == ([], [])          # nothing under way yet
    proxy.feed(1, b"cmd=init pmi_version=1 pmi_subversion=1\ncmd=barrier_in\n")
    assert proxy.holding_up() == ([5, 6], [])
    proxy.closed(3)                                # rank 6 left without a PMI word
    assert proxy.holding_up() == ([5, 6], [6])
    assert proxy.holding_up(host_waited=True) == ([5, 6], [6])


def test_mpi_init_begun_by_some_ranks_names_those_that_never_spoke():
    proxy = PmiProxy(ranks=[0, 1], world_size=2, kvsname="k", process_mapping="")
    proxy.open(1, 0)
    proxy.open(2, 1)
    proxy.feed(1, b"cmd=init pmi_version=1 pmi_subversion=1\n")
    proxy.exited(1)                                # PMI_PORT mode learns it from the agent
    assert proxy.holding_up() == ([1], [1])
    assert proxy.holding_up(host_waited=True) == ([1], [1])  # rank 0 waits for rank 1


def test_a_host_the_head_waits_for_names_every_rank_outside_the_barrier():
    proxy = PmiProxy(ranks=[2, 3], world_size=4, kvsname="k", process_mapping="")
    proxy.open(1, 2)
    proxy.open(2, 3)
    assert proxy.holding_up() == ([], [])
    assert proxy.holding_up(host_waited=True) == ([2, 3], [])
    proxy.feed(1, b"cmd=init pmi_version=1 pmi_subversion=1\ncmd=barrier_in\n")
    proxy.feed(2, b"cmd=init pmi_version=1 pmi_subversion=1\n")
    assert proxy.holding_up(host_waited=True) == ([3], [])


def test_a_refused_feature_is_told_once_per_job():
    said: list[str] = []
    notes = PmiNotes(30.0, said.append)
    notes.unsupported(3, "node2", "MPI_Comm_spawn")
    notes.unsupported(1, "node1", "MPI_Comm_spawn")
    notes.unsupported(1, "node1", "MPI_Publish_name")
    assert said[0].startswith("rank 3@node2 called MPI_Comm_spawn, which dtrain's PMI does "
                              "not support")
    assert len(said) == 2 and "rank 1@node1 called MPI_Publish_name" in said[1]


def test_the_head_asks_the_waiting_hosts_and_prints_one_line_naming_only_missing_ranks():
    said: list[str] = []
    notes = PmiNotes(5.0, said.append)
    waiting = {1: "node2", 2: "node3"}
    assert notes.tick(0.0, waiting, epoch=0) == []
    assert notes.tick(5.0, waiting, epoch=0) == [1, 2]
    notes.answer(1, {"ranks": [3], "gone": []})
    assert said == []                              # waits for every asked host
    notes.answer(2, {"ranks": [5, 4], "gone": [5]})
    assert said == ["PMI barrier (MPI_Init or a fence) has waited 5s for ranks 3@node2, "
                    "4@node3, 5@node3; exited without calling MPI_Init: 5@node3 (every rank "
                    "of an MPI job must call MPI_Init)"]
    assert notes.tick(7.0, waiting, epoch=0) == []  # once per interval
    assert notes.tick(10.0, {1: "node2"}, epoch=0) == [1]
    assert notes.tick(15.0, {1: "node2"}, epoch=0) == [1]  # node2 never answered
    assert said[-1].endswith("for ranks none known; no answer from hosts node2")


def test_an_agent_report_is_relayed_only_when_the_head_is_not_itself_waiting():
    said: list[str] = []
    notes = PmiNotes(5.0, said.append)
    notes.agent_stall("node1", {"ranks": [1], "gone": [1], "seconds": 5}, head_waiting=True)
    assert said == []
    notes.agent_stall("node1", {"ranks": [1], "gone": [], "seconds": 5}, head_waiting=False)
    assert said == ["PMI barrier (MPI_Init or a fence) has waited 5s for ranks 1@node1"]


# ----- real MPICH ranks ------------------------------------------------------------------------

SKIP_RANK = ("import os, sys\n"
             "if os.environ['RANK'] == os.environ['SKIP']:\n"
             "    sys.exit(0)  # never calls MPI_Init\n"
             "from mpi4py import MPI\n"
             "MPI.COMM_WORLD.Barrier()\n")


def _stall_lines(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if "PMI barrier" in x]


@pytest.mark.parametrize("pmi", ["fd", "port"])
def test_a_rank_that_exits_0_before_mpi_init_is_named_while_the_others_wait(pmi):
    res = run_dtrain(["launch", "--nproc-per-node", "3", "--pmi", pmi, "--pmi-stall", "1",
                      "--timeout", "5",
                      "--grace", "1", "--env", "SKIP=1", "--", PYTHON, "-c", SKIP_RANK])
    assert res.returncode == 124, res.stderr
    lines = _stall_lines(res.stderr)
    assert lines, res.stderr
    assert all(re.search(r"for ranks 1@localhost; exited without calling MPI_Init: "
                         r"1@localhost", x) for x in lines), lines
    seconds = [int(re.search(r"waited (\d+)s", x).group(1)) for x in lines]
    assert seconds == sorted(set(seconds)) and len(lines) <= 5  # once per interval


def test_a_stall_across_hosts_names_the_missing_rank_not_its_whole_host(netns_cluster, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=2\nnode2 slots=2\n")
    res = run_dtrain(["launch", "-f", str(hostfile), "--ssh-config",
                      str(netns_cluster.ssh_config), "--pmi-stall", "2", "--timeout", "8",
                      "--grace", "1", "--env", "SKIP=3", "--", PYTHON, "-c", SKIP_RANK],
                     timeout=90)
    assert res.returncode == 124, res.stderr
    lines = _stall_lines(res.stderr)
    assert lines, res.stderr
    for line in lines:
        assert "for ranks 3@node2; exited without calling MPI_Init: 3@node2" in line, lines
    left = netns_cluster.wait_no_job_pids(10)
    assert not left, left


@pytest.mark.parametrize("call, feature", [
    ("MPI.COMM_SELF.Spawn(sys.executable, args=['-c', 'pass'], maxprocs=1)", "MPI_Comm_spawn"),
    ("MPI.Publish_name('svc', 'port')", "MPI_Publish_name"),
])
def test_a_refused_mpi_feature_is_named_once_by_dtrain(call, feature):
    code = f"import sys\nfrom mpi4py import MPI\n{call}\n"
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--grace", "1", "--", PYTHON, "-c",
                      code])
    assert res.returncode == 1, res.stderr
    told = [x for x in res.stderr.splitlines() if x.startswith("dtrain: rank ")]
    assert len(told) == 1, res.stderr
    assert re.match(rf"dtrain: rank [01]@localhost called {feature}, which dtrain's PMI does "
                    "not support", told[0])
