"""The network-namespace cluster fixture behaves like separate hosts and cleans up after itself."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from launcher.transport.ssh import SSHConnection, SSHOptions, resolve_host
from testbed.netns import NetnsCluster, netns_available, reap_stale


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
    namespaces = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True,
                                text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], check=False, capture_output=True, text=True).stdout
    assert namespace not in namespaces
    assert bridge not in links and f"dtv{cluster.suffix}" not in links
    assert not cluster.dir.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(daemon, 0)


def test_cluster_of_a_killed_session_is_reaped_by_the_next_one(venv_python):
    usable, reason = netns_available()
    if not usable:
        pytest.skip(f"netns cluster: {reason}")
    script = ("from testbed.netns import NetnsCluster; import time; "
              "c = NetnsCluster(1); print(c.namespace('node1'), c.sshd_pid('node1'), c.dir, "
              "flush=True); time.sleep(60)")
    session = subprocess.Popen([venv_python, "-c", script], stdout=subprocess.PIPE, text=True,
                               cwd=os.getcwd())
    try:
        namespace, daemon, scratch = session.stdout.readline().split()
    finally:
        session.kill()  # SIGKILL: no atexit, the namespace and its sshd are left behind
        session.wait()
        session.stdout.close()
    assert namespace in subprocess.run(["ip", "netns", "list"], check=False,
                                       capture_output=True, text=True).stdout
    assert Path(scratch).is_dir()
    reap_stale()
    assert namespace not in subprocess.run(["ip", "netns", "list"], check=False,
                                           capture_output=True, text=True).stdout
    assert not Path(scratch).exists()
    deadline = time.monotonic() + 5
    while Path(f"/proc/{daemon}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{daemon}").exists()
