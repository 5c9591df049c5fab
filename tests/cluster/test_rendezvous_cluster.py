"""Rendezvous mode on four network-namespace hosts that run no sshd: each host starts `dtrain
agent --rendezvous` itself (as a Kubernetes pod would), the head listens on the host side.

Every agent runs in its host's namespace with a host name of its own (a UTS namespace), so
the roster orders node1..node4 by name. After every test no process remains on any host
within 10 s, and every agent this test started has exited (those still retrying are killed
by their recorded PIDs).
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launcher.agent.main import EOF_GRACE_S
from testbed.sshd import free_port
from tests.support import PYTHON, REPO, dtrain_cmd, dtrain_env, start_dtrain

PROBE = str(REPO / "tests" / "support" / "workers" / "probe.py")
HEARTBEAT_S, MISSES = 1.0, 3
TRAIN = ["-m", "trainer.train", "--model", "tiny", "--n-layer", "1", "--d-model", "32",
         "--seq-len", "32", "--global-batch", "8", "--steps", "3", "--log-every", "1",
         "--eval-every", "0", "--data-cap-mb", "0.25"]


def _token(path: Path) -> Path:
    """A new token in ``path``, made as a user makes one: `dtrain token new > path`."""
    with path.open("w") as out:
        subprocess.run(dtrain_cmd(["token", "new"]), stdout=out, check=True, cwd=REPO,
                       env=dtrain_env())
    return path


class Rendezvous:
    """The head's port and token on one side of the bridge, agents started in the hosts."""

    def __init__(self, cluster, tmp_path: Path) -> None:
        self.cluster, self.tmp = cluster, tmp_path
        self.port = free_port(cluster.head_address)
        self.token = _token(tmp_path / "token")
        self.pid_dir = tmp_path / "pids"
        self.pid_dir.mkdir()
        self.agents: list[subprocess.Popen[str]] = []

    def agent(self, host: str, *, delay: float = 0.0, name: str | None = None,
              token: Path | None = None, join_timeout: float = 30) -> subprocess.Popen[str]:
        """`dtrain agent` in ``host``'s namespace, named ``name``, after ``delay`` seconds."""
        command = dtrain_cmd(["agent", "--rendezvous", f"{self.cluster.head_address}:{self.port}",
                              "--token-file", str(token or self.token), "--join-timeout",
                              f"{join_timeout:g}"])
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.cluster.namespace(host), "unshare", "--uts", "--", "sh",
             "-c", 'hostname "$1" && sleep "$2" && shift 2 && exec "$@"', "sh", name or host,
             f"{delay:.2f}", *command],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env=dtrain_env({"PROBE_PID_DIR": str(self.pid_dir)}), start_new_session=True)
        self.agents.append(proc)
        return proc

    def head(self, program: list[str], *options: str, nnodes: int = 4) -> subprocess.Popen[str]:
        return start_dtrain(["launch", "--rendezvous-port", str(self.port), "--rendezvous-host",
                             self.cluster.head_address, "--nnodes", str(nnodes), "--token-file",
                             str(self.token), "--nproc-per-node", "2", "--heartbeat-interval",
                             str(HEARTBEAT_S), "--grace", "2", *options, "--", *program])

    def ranks_running(self, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(list(self.pid_dir.glob("*.pid"))) < count:
            assert time.monotonic() < deadline, "the ranks did not all start"
            time.sleep(0.1)

    def close(self) -> None:
        for proc in self.agents:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


@pytest.fixture
def rdzv(bare_cluster, tmp_path):
    rendezvous = Rendezvous(bare_cluster, tmp_path)
    yield rendezvous
    rendezvous.close()
    left = bare_cluster.wait_no_job_pids(10)
    assert not left, f"job processes left on hosts: {left}"


def test_four_agents_joining_in_any_order_form_one_mpi_world_of_8_ranks_that_trains(
        rdzv, tmp_path):
    delays = [random.uniform(0, 5) for _ in rdzv.cluster.hosts]
    head = rdzv.head([PYTHON, *TRAIN, "--run-dir", str(tmp_path / "run")])
    agents = [rdzv.agent(host, delay=d) for host, d in zip(rdzv.cluster.hosts, delays,
                                                           strict=True)]
    out, err = head.communicate(timeout=300)
    assert head.returncode == 0, f"delays {delays}\n{err[-3000:]}"
    assert "[0@node1] dtrain: tiny GPT" in out + err and "world 8 = dp 8" in out + err
    assert "8 ranks on 4 hosts exited 0" in err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [a.wait(30) for a in agents] == [0, 0, 0, 0]


def test_a_failing_rank_stops_every_rank_on_every_host(rdzv):
    head = rdzv.head([PYTHON, PROBE, "fail", "5", "7"])
    agents = [rdzv.agent(host) for host in rdzv.cluster.hosts]
    _, err = head.communicate(timeout=120)
    assert head.returncode == 7, err
    assert "first failure: rank 5@node3: exited with code 7" in err  # ordered by host name
    assert all(a.wait(30) != 0 for a in agents)


def test_an_agent_with_an_old_token_changes_nothing_and_the_job_runs_once_the_right_one_joins(
        rdzv):
    old = _token(rdzv.tmp / "old")
    head = rdzv.head([PYTHON, PROBE, "argv", "ok"])
    agents = [rdzv.agent(host) for host in rdzv.cluster.hosts[:3]]
    stale = rdzv.agent("node4", token=old, join_timeout=4)
    _, stale_err = stale.communicate(timeout=60)
    assert stale.returncode == 255, stale_err
    assert "the head did not accept this agent's token" in stale_err
    assert "dtrain token new" in stale_err  # how to make the one both sides share
    assert head.poll() is None  # the head still waits: a stranger cannot end the rendezvous
    agents.append(rdzv.agent("node4"))
    _, err = head.communicate(timeout=120)
    assert head.returncode == 0, err
    address = rdzv.cluster.address("node4")
    [line] = [line for line in err.splitlines() if f"from {address}:" in line]  # one, rate-limited
    assert "does not match the head's token" in line and "the rendezvous goes on" in line
    assert [a.wait(30) for a in agents] == [0, 0, 0, 0]


def test_three_of_four_agents_time_out_naming_the_hosts_that_came_and_where_the_token_failed(
        rdzv):
    head = rdzv.head([PYTHON, PROBE, "sleep", "60"], "--rendezvous-timeout", "8")
    agents = [rdzv.agent(host) for host in rdzv.cluster.hosts[:3]]
    stale = rdzv.agent("node4", token=_token(rdzv.tmp / "old"), join_timeout=20)
    _, err = head.communicate(timeout=60)
    assert head.returncode == 255, err
    assert "the rendezvous did not complete" in err
    assert "3 of 4 agents joined within 8s: " in err
    for host in rdzv.cluster.hosts[:3]:
        assert f"{host} ({rdzv.cluster.address(host)})" in err
    assert f"agents failed the token (or version) from {rdzv.cluster.address('node4')} (" in err
    for agent in agents:
        _, agent_err = agent.communicate(timeout=30)
        assert agent.returncode != 0 and "the head stopped before the start" in agent_err
    _, stale_err = stale.communicate(timeout=30)
    assert stale.returncode == 255 and "did not accept this agent's token" in stale_err
    assert list(rdzv.pid_dir.iterdir()) == []


def test_a_late_agent_is_refused_and_a_sigkilled_head_makes_every_agent_stop_its_ranks(rdzv):
    head = rdzv.head([PYTHON, PROBE, "sleep", "60"])
    agents = [rdzv.agent(host) for host in rdzv.cluster.hosts]
    rdzv.ranks_running(8)
    late = rdzv.agent("node1", name="node5")
    _, late_err = late.communicate(timeout=30)
    assert late.returncode == 255
    assert "the job already started with 4 agents" in late_err
    head.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    codes = [a.wait(30) for a in agents]
    stopped = time.monotonic() - t0
    assert all(code != 0 for code in codes)
    assert stopped < HEARTBEAT_S * MISSES + EOF_GRACE_S
    _, err = head.communicate(timeout=10)
    assert "refused the agent node5" in err and "already started" in err
