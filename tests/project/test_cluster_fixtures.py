"""The network-namespace cluster fixture behaves like separate hosts and cleans up after itself."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from launcher.transport.ssh import SSHConnection, SSHOptions, resolve_host
from testbed.netns import NetnsCluster, netns_available, reap_stale
from testbed.sshd import (
    FAST_CLIENT_ALIVE,
    REALISTIC_CLIENT_ALIVE,
    DaemonExited,
    free_port,
    sshd_config_text,
    stop_process,
    wait_for_port,
)
from testbed.stale import STATE_DIR
from tests.support import alive, wait_gone

# Namespace hosts and sshds of its own, timed against sshd's keepalives: with the machine to
# itself in make test (tests/conftest.py).
pytestmark = pytest.mark.alone


def _open(cluster: NetnsCluster, host: str) -> SSHConnection:
    opts = SSHOptions(config_file=cluster.ssh_config)
    return SSHConnection.open(resolve_host(host, user=None, port=None, opts=opts), opts)


def test_each_host_reports_its_own_hostname_and_address_over_ssh(netns_cluster):
    for host in netns_cluster.hosts:
        conn = _open(netns_cluster, host)
        try:
            code, out, _ = conn.run("hostname; ip -4 -o addr show dev eth0", timeout=10)
        finally:
            conn.close()
        name, addresses = out.decode().split("\n", 1)
        assert (code, name) == (0, host)
        assert f" {netns_cluster.address(host)}/24 " in addresses


def test_sshd_drops_a_silent_head_after_45_s_and_only_the_cut_cable_fixture_after_3(
        netns_cluster):
    # A head on a loaded machine may answer sshd's probes seconds late (64 hosts' agents and
    # ranks starting on two cores); only tests that cut cables need sshd to give up quickly.
    default = sshd_config_text(listen="10.0.0.2", port=22, host_key=Path("key"),
                               pid_file=Path("pid"), authorized_keys=Path("keys"))
    assert "ClientAliveInterval 15\nClientAliveCountMax 3\n" in default
    assert REALISTIC_CLIENT_ALIVE.interval * REALISTIC_CLIENT_ALIVE.count_max == 45
    written = (netns_cluster.dir / "node1_sshd_config").read_text()
    assert netns_cluster.client_alive == FAST_CLIENT_ALIVE
    assert "ClientAliveInterval 1\nClientAliveCountMax 3\n" in written


def test_waiting_for_a_port_tells_a_daemon_that_exited_from_one_that_never_listened(tmp_path):
    # Slurm's controller is started again on another port only when it exited on a taken one.
    log = tmp_path / "daemon.log"
    log.write_text("bind: Address already in use\n")
    exited = subprocess.Popen(["sh", "-c", "exit 3"])
    with pytest.raises(DaemonExited, match="(?s)daemon did not start.*exited with 3.*in use"):
        wait_for_port("127.0.0.1", free_port(), exited, log, name="daemon")
    silent = subprocess.Popen(["sleep", "60"])
    try:
        with pytest.raises(RuntimeError, match="(?s)not accepting.*in use") as raised:
            wait_for_port("127.0.0.1", free_port(), silent, log, name="daemon", timeout=0.5)
        assert not isinstance(raised.value, DaemonExited)
    finally:
        stop_process(silent)


def test_job_pids_is_empty_when_idle(netns_cluster):
    assert netns_cluster.wait_no_job_pids(timeout=10) == {}
    for host in netns_cluster.hosts:
        assert netns_cluster.pids(host) == {netns_cluster.sshd_pid(host)}


def test_a_running_remote_command_shows_in_job_pids_until_it_exits(netns_cluster):
    conn = _open(netns_cluster, "node2")
    try:
        stream = conn.exec_stream("echo started; exec cat")
        assert stream.read() == b"started\n"
        assert netns_cluster.job_pids("node2"), "the session and cat run inside node2"
        assert not netns_cluster.job_pids("node1")
        stream.close()  # cat sees EOF and exits
        assert stream.wait(10) == 0
    finally:
        conn.close()
    assert netns_cluster.wait_no_job_pids(timeout=10) == {}


def test_closing_leaves_no_namespace_link_or_process_behind():
    usable, reason = netns_available()
    if not usable:
        pytest.skip(f"netns cluster: {reason}")
    cluster = NetnsCluster(1)
    namespace, bridge = cluster.namespace("node1"), cluster.bridge
    daemon = cluster.sshd_pid("node1")
    cluster.close()
    cluster.close()  # idempotent
    links = subprocess.run(["ip", "-o", "link"], check=False, capture_output=True, text=True).stdout
    assert namespace not in _namespaces()
    assert bridge not in links and f"dtv{cluster.suffix}" not in links
    assert not cluster.dir.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(daemon, 0)


def _killed_session(python: str, script: str) -> list[str]:
    """Run ``script`` (which builds clusters and prints a line about them) and SIGKILL it once
    it has printed: no atexit runs, so what it built is left behind. Returns the line's words."""
    session = subprocess.Popen([python, "-c", script + "; import time; time.sleep(60)"],
                               stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        return session.stdout.readline().split()
    finally:
        session.kill()
        session.wait()
        session.stdout.close()


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], check=False, capture_output=True,
                          text=True).stdout


def test_cluster_of_a_killed_session_is_reaped_by_the_next_one(venv_python):
    usable, reason = netns_available()
    if not usable:
        pytest.skip(f"netns cluster: {reason}")
    namespace, daemon, scratch = _killed_session(venv_python, (
        "from testbed.netns import NetnsCluster; c = NetnsCluster(1); "
        "print(c.namespace('node1'), c.sshd_pid('node1'), c.dir, flush=True)"))
    assert namespace in _namespaces() and Path(scratch).is_dir()
    reap_stale()
    assert namespace not in _namespaces()
    assert not Path(scratch).exists()
    assert wait_gone([int(daemon)], timeout=5) == set()


def test_a_killed_session_with_a_slurm_cluster_is_reaped_by_the_next_one(venv_python):
    """The netns reaper runs first and must pass over the Slurm state it cannot read (CI once
    failed there); then the Slurm reaper stops the daemons the killed session left."""
    from testbed import slurm

    usable, reason = slurm.slurm_available()
    if not usable:
        pytest.skip(f"slurm cluster: {reason}")
    namespace, *scratch, suffix = _killed_session(venv_python, (
        "from testbed.netns import NetnsCluster; from testbed.slurm import SlurmCluster; "
        "n = NetnsCluster(1, sshd=False); s = SlurmCluster(n); "
        "print(n.namespace('node1'), n.dir, s.dir, n.suffix, flush=True)"))
    state = json.loads((STATE_DIR / f"slurm-{suffix}.json").read_text())
    daemons = [pid for pid, _ in state["pids"]]
    assert daemons and all(alive(pid) for pid in daemons)
    reap_stale()
    slurm.reap_stale()
    assert wait_gone(daemons, timeout=5) == set()
    assert namespace not in _namespaces()
    assert not [d for d in scratch if Path(d).exists()]
    assert not list(STATE_DIR.glob(f"*-{suffix}.json"))


def test_a_slurm_controller_whose_port_was_taken_meanwhile_starts_on_another(monkeypatch):
    """The controller's port is picked free but not reserved, and a parallel test may take it
    first (CI, 2026-11-30): the cluster starts its controller again on another port."""
    import socket

    from testbed import slurm
    from testbed.sshd import free_port

    usable, reason = slurm.slurm_available()
    if not usable:
        pytest.skip(f"slurm cluster: {reason}")
    netns = NetnsCluster(1, sshd=False)
    try:
        with socket.socket() as taker:
            taker.bind((netns.head_address, 0))
            taken = taker.getsockname()[1]
            picks = iter([taken])
            monkeypatch.setattr(slurm, "free_port",
                                lambda host: next(picks, None) or free_port(host))
            cluster = slurm.SlurmCluster(netns)
            try:
                assert cluster.port != taken
                assert cluster.node_states() == {"node1": "idle"}
            finally:
                cluster.close()
    finally:
        netns.close()
