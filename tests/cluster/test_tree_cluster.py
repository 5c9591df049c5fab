"""`dtrain launch --fanout 2` on 16 namespace hosts: relays start the agents below them.

With --fanout 2 the head starts node1 and node2; node1 starts node3 and node4, node2 starts
node5 and node6, and so on (`launcher.tree.shape`): four levels, seven relays. Every test
checks, as the flat launch's do, that nothing of the job is left on any host afterwards
(`ip netns pids`). The 16 hosts are this module's own (made once, about a second per host).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.netns import NetnsCluster, netns_available
from tests.cluster.test_restart_cluster import WORKER, Head, _rank_pid, _rounds
from tests.support import PYTHON, run_dtrain

HOSTS = 16
# Stops and restarts without waiting; `_launch` leaves the heartbeat long: a host is given three
# intervals to say HELLO, and 16 logins at once on a loaded machine (each running the login
# shell's start-up files) can take longer than the default's 15 s for the hosts the head
# starts itself, flat or not. No test here waits for a heartbeat to be missed.
FAST = ["--grace", "3", "--restart-backoff", "0"]
MPI_WORLD = ("from mpi4py import MPI; import json, sys\n"
             "c = MPI.COMM_WORLD\n"
             "print(json.dumps([c.rank, c.size, c.allreduce(c.rank + 1), "
             "MPI.Get_processor_name()]))\n"
             "sys.exit(int(sys.argv[1]) if c.rank == int(sys.argv[2]) else 0)\n")


@pytest.fixture(scope="module")
def sixteen() -> Iterator[NetnsCluster]:
    usable, reason = netns_available()
    if not usable:
        pytest.skip(f"netns cluster: {reason}")
    hosts = NetnsCluster(HOSTS)
    yield hosts
    hosts.close()


@pytest.fixture
def tree(sixteen: NetnsCluster) -> Iterator[NetnsCluster]:
    yield sixteen
    left = sixteen.wait_no_job_pids(15)
    assert not left, f"job processes left on hosts: {left}"


def _hostfile(tmp_path: Path) -> Path:
    path = tmp_path / "hostfile"
    path.write_text("".join(f"node{i} slots=1\n" for i in range(1, HOSTS + 1)))
    return path


def _launch(cluster: NetnsCluster, tmp_path: Path, *extra: str) -> list[str]:
    return ["launch", "-f", str(_hostfile(tmp_path)), "--ssh-config", str(cluster.ssh_config),
            "--fanout", "2", "--heartbeat-interval", "8", *extra]


def _worlds(stdout: str) -> dict[int, list]:
    rows = [json.loads(line.partition("] ")[2]) for line in stdout.splitlines()
            if line.startswith("[")]
    return {row[0]: row for row in rows}


def test_a_tree_launch_forms_one_mpi_world_of_every_rank_with_flat_outputs_and_codes(
        tree, tmp_path):
    res = run_dtrain(_launch(tree, tmp_path, "--", PYTHON, "-c", MPI_WORLD, "0", "0"),
                     timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    world = _worlds(res.stdout)
    assert sorted(world) == list(range(HOSTS))
    assert {(size, total) for _, size, total, _ in world.values()} == {(HOSTS, 136)}
    assert [world[r][3] for r in range(HOSTS)] == [f"node{i}" for i in range(1, HOSTS + 1)]
    assert f"[15@node16] {json.dumps(world[15])}" in res.stdout  # prefixed as flat

    # A rank four hops down exits 3: the job's code and report, as for a flat launch.
    failed = run_dtrain(_launch(tree, tmp_path, "--", PYTHON, "-c", MPI_WORLD, "3", "14"),
                        timeout=180)
    assert failed.returncode == 3, failed.stderr[-3000:]
    assert "rank 14@node15: exited with code 3" in failed.stderr


EARLY_RELAYS = ("import os, time\n"
                "rank = int(os.environ['RANK'])\n"
                "time.sleep(0 if rank < 2 else 3)  # node1 and node2 relay: their ranks end first\n"
                "print('done', rank)\n")


def test_relays_over_the_system_ssh_client_form_the_world_and_outlive_their_own_ranks(
        tree, tmp_path):
    res = run_dtrain(_launch(tree, tmp_path, "--ssh-client", "openssh", "--", PYTHON, "-c",
                             MPI_WORLD, "0", "0"), timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    world = _worlds(res.stdout)
    assert sorted(world) == list(range(HOSTS))
    assert {(size, total) for _, size, total, _ in world.values()} == {(HOSTS, 136)}

    # The relays' own ranks end first: their `ssh` links to the hosts below are not leftovers.
    early = run_dtrain(_launch(tree, tmp_path, "--ssh-client", "openssh", "--", PYTHON, "-c",
                               EARLY_RELAYS), timeout=180)
    assert early.returncode == 0, early.stderr[-3000:]
    assert sorted(int(line.split()[-1]) for line in early.stdout.splitlines()
                  if " done " in line) == list(range(HOSTS))


def test_dry_run_shows_the_tree_and_starts_nothing(tree, tmp_path):
    res = run_dtrain(_launch(tree, tmp_path, "--dry-run", "--", PYTHON, "-c", "pass"))
    assert res.returncode == 0, res.stderr
    assert "fan-out 2: 7 relays, depth 4" in res.stdout
    assert "head -> node1, node2" in res.stdout and "node2 -> node5, node6" in res.stdout


def _agent_pid(cluster: NetnsCluster, host: str) -> int:
    for pid in cluster.job_pids(host):
        try:
            if b"launcher.agent" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise AssertionError(f"no agent on {host}")


def test_a_relay_killed_mid_job_ends_the_job_naming_its_subtree(tree, tmp_path):
    head = Head(_launch(tree, tmp_path, *FAST, "--", PYTHON, WORKER, "sleep-first"))
    head.wait_for(lambda: "".join(head.out).count("up\n") == HOSTS)
    os.kill(_agent_pid(tree, "node2"), signal.SIGKILL)  # relay of node5, 6, 11-14
    code, _out, err = head.finish()
    assert code == 255, err[-3000:]
    for host in ("node2", "node5", "node6", "node11", "node12", "node13", "node14"):
        assert host in err, (host, err[-3000:])


def test_a_rank_failure_under_a_relay_restarts_like_any_failure(tree, tmp_path):
    head = Head(_launch(tree, tmp_path, "--max-restarts", "1", *FAST, "--", PYTHON, WORKER,
                        "sleep-first"))
    head.wait_for(lambda: "".join(head.out).count("up\n") == HOSTS)
    os.kill(_rank_pid(tree, "node14", "restart_worker.py"), signal.SIGKILL)
    code, out, err = head.finish()
    assert code == 0, err[-3000:]
    again = {r["rank"]: r["host"] for r in _rounds(out) if r["round"] == 1}
    assert again == {r: f"node{r + 1}" for r in range(HOSTS)}


def test_a_job_refused_at_start_up_leaves_nothing_on_any_host(tree, tmp_path):
    res = run_dtrain(_launch(tree, tmp_path, "--chdir", "/nonexistent/dtrain", "--", PYTHON,
                             "-c", "pass"), timeout=120)
    assert res.returncode == 255, res.stderr[-3000:]
    assert "/nonexistent/dtrain" in res.stderr


def test_the_head_killed_mid_job_leaves_nothing_on_any_host(tree, tmp_path):
    head = Head(_launch(tree, tmp_path, *FAST, "--", PYTHON, WORKER, "sleep-first"))
    head.wait_for(lambda: "".join(head.out).count("up\n") == HOSTS)
    head.proc.send_signal(signal.SIGKILL)
    head.finish()
