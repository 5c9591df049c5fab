"""Shared fixtures: a real sshd on loopback, a 4-host network-namespace cluster, a 4-host one
without sshd, a real Slurm over three namespace hosts, the venv python.

Tests using `sshd` or `netns_cluster` are marked ``sshd``/``netns`` automatically, so
``pytest -m "not netns"`` deselects them; they skip with the reason when the machine cannot
run them (not root, no sshd binary, no ``ip netns``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.netns import NetnsCluster, netns_available
from testbed.slurm import SlurmCluster, slurm_available
from testbed.sshd import FAST_CLIENT_ALIVE, SshdServer, sshd_available

os.environ.setdefault("OMP_NUM_THREADS", "1")
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def sshd() -> Iterator[SshdServer]:
    """One OpenSSH sshd on 127.0.0.1 for the session; see `SshdServer` for its files."""
    if os.geteuid() != 0:
        pytest.skip("sshd fixture needs root (sshd must run as root to switch users)")
    if not sshd_available():
        pytest.skip("no OpenSSH sshd/ssh-keygen; run `make sysdeps` as root")
    server = SshdServer()
    yield server
    server.close()


@pytest.fixture(scope="session")
def netns_cluster() -> Iterator[NetnsCluster]:
    """Hosts node1..node4 in network namespaces behind a bridge, each with its own sshd (most
    tests use three; restarts need a fourth: a spare, or a host to lose).

    Its sshds drop a silent head after 3 s (`FAST_CLIENT_ALIVE`, not a cluster's tens of
    seconds): tests cut a host's cable and then check within seconds that nothing is left on
    it, and on the cut host only sshd's own probes end the session of the head it can no
    longer reach (test_ssh's keepalive test, the lost-host tests of test_launch_cluster and
    test_restart_cluster)."""
    usable, reason = netns_available()
    if not usable:
        pytest.skip(f"netns cluster: {reason}")
    cluster = NetnsCluster(4, client_alive=FAST_CLIENT_ALIVE)
    yield cluster
    cluster.close()


@pytest.fixture
def cluster(netns_cluster: NetnsCluster) -> Iterator[NetnsCluster]:
    """The session's namespace hosts for one test: afterwards every cable a test cut is back
    and no process of a job is left on any host."""
    yield netns_cluster
    for host in netns_cluster.hosts:
        netns_cluster.link_up(host)
    left = netns_cluster.wait_no_job_pids(10)
    assert not left, f"job processes left on hosts: {left}"


@pytest.fixture(scope="session")
def bare_cluster() -> Iterator[NetnsCluster]:
    """Hosts node1..node4 in network namespaces that run no sshd: what a Kubernetes node pool
    or a fleet without node-to-node SSH looks like (rendezvous mode; a test may start sshd on
    a host, late, and must stop it)."""
    usable, reason = netns_available()
    if not usable:
        pytest.skip(f"netns cluster: {reason}")
    cluster = NetnsCluster(4, sshd=False)
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A real Slurm (slurmctld, munged, one slurmd per host) over namespace hosts node1..node3
    that run no sshd: what a cluster that forbids SSH between nodes looks like."""
    for usable, reason in (netns_available(), slurm_available()):
        if not usable:
            pytest.skip(f"slurm cluster: {reason}")
    hosts = NetnsCluster(3, sshd=False)
    try:
        cluster = SlurmCluster(hosts)
        yield cluster
        cluster.close()
    finally:
        hosts.close()


@pytest.fixture(scope="session")
def venv_python() -> str:
    """The interpreter running the tests (the project's venv), for subprocesses and agents."""
    return sys.executable


ALONE = {"launcher", "cluster"}
"""Test folders whose tests time real processes against each other (heartbeats, stalls, hang
deadlines, launch races). ``make test`` runs them with the machine to itself, together with
every test of an sshd or namespace host and the modules that mark themselves ``alone``; the
rest share its cores (pytest-xdist)."""

NAMESPACE_HOSTS = {"netns_cluster", "slurm_cluster", "bare_cluster"}
"""The fixtures that bring up network-namespace hosts."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if "sshd" in names:
            item.add_marker(pytest.mark.sshd)
        if NAMESPACE_HOSTS & names:
            item.add_marker(pytest.mark.netns)
        folder = item.path.relative_to(TESTS).parts[0]
        if folder in ALONE or "sshd" in names or NAMESPACE_HOSTS & names:
            item.add_marker(pytest.mark.alone)
