"""A venv-activated head's `python` is the ranks' `python` on every host (and check says so).

The venv lives in the test's tmp directory, which the namespace hosts share with the head; the
hosts' own login PATH (what sshd gives a session) does not contain it. To make one host lack
the venv, the test mounts an empty tmpfs over its directory inside that host's mount namespace
only (`ip netns exec` gives each host's sshd its own).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.transport.ssh import SSHConnection, SSHOptions, resolve_host
from tests.support import PYTHON, run_dtrain

SHOW = "import json, sys; print(json.dumps([sys.executable, sys.prefix]))"


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    path = tmp_path / "venv"
    subprocess.run([PYTHON, "-m", "venv", "--system-site-packages", "--without-pip", str(path)],
                   check=True, capture_output=True)
    return path


def _activated(venv: Path) -> dict[str, str]:
    """What `source venv/bin/activate` does to the head's environment."""
    return {"PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}


def _login_path(cluster, host: str) -> str:
    opts = SSHOptions(config_file=cluster.ssh_config)
    conn = SSHConnection.open(resolve_host(host, user=None, port=None, opts=opts), opts)
    try:
        code, out, _ = conn.run("echo $PATH", timeout=10)
    finally:
        conn.close()
    assert code == 0
    return out.decode().strip()


def _by_rank(stdout: str) -> dict[str, list[str]]:
    return {line.partition("] ")[0][1:]: json.loads(line.partition("] ")[2])
            for line in stdout.splitlines() if line.startswith("[")}


def test_ranks_on_every_host_run_the_heads_venv_python(cluster, venv):
    for host in ("node1", "node2"):
        assert str(venv) not in _login_path(cluster, host)  # the host alone would not find it
    res = run_dtrain(["launch", "-H", "node1:2,node2:1", "--ssh-config",
                      str(cluster.ssh_config), "--", "python", "-c", SHOW], env=_activated(venv))
    assert res.returncode == 0, res.stderr
    ranks = _by_rank(res.stdout)
    assert sorted(ranks) == ["0@node1", "1@node1", "2@node2"]
    for executable, prefix in ranks.values():
        assert (executable, prefix) == (str(venv / "bin" / "python"), str(venv))


def test_the_issue_command_imports_mpi4py_from_the_heads_venv_on_every_host(cluster):
    # `dtrain launch -H node1:2,node2:2 -- python -c "from mpi4py import MPI"` from a head
    # with the project's venv (the one with mpi4py) active: the hosts' own python lacks it.
    head_venv = Path(sys.prefix)
    assert head_venv != Path(sys.base_prefix), "the tests run outside a virtualenv"
    res = run_dtrain(["launch", "-H", "node1:2,node2:2", "--ssh-config", str(cluster.ssh_config),
                      "--", "python", "-c", "from mpi4py import MPI; print(MPI.COMM_WORLD.size)"],
                     env=_activated(head_venv))
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.split()) == ["4"] * 4 + [
        "[0@node1]", "[1@node1]", "[2@node2]", "[3@node2]"]


@pytest.fixture
def venv_hidden_on_node3(cluster, venv):
    """An empty tmpfs over the venv's directory in node3's mount namespace: there, the venv's
    path does not exist."""
    target = ["nsenter", "--target", str(cluster.sshd_pid("node3")), "--mount", "--"]
    assert os.readlink(f"/proc/{cluster.sshd_pid('node3')}/ns/mnt") != os.readlink(
        "/proc/self/ns/mnt"), "node3's sshd shares our mount namespace"
    subprocess.run([*target, "mount", "-t", "tmpfs", "tmpfs", str(venv.parent)], check=True)
    try:
        yield venv
    finally:
        subprocess.run([*target, "umount", str(venv.parent)], check=True)


def test_check_flags_a_host_where_the_heads_venv_is_missing(cluster, venv_hidden_on_node3):
    venv = venv_hidden_on_node3
    res = run_dtrain(["check", "-H", "node1:1,node3:1", "--ssh-config", str(cluster.ssh_config)],
                     env=_activated(venv))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "problems on 1 of 2 hosts: node3" in res.stderr  # node1 runs the head's python
    problem = next(line for line in res.stdout.splitlines() if line.startswith("node3: `python`"))
    assert f"(head {venv / 'bin' / 'python'})" in problem
    assert f"missing here: VIRTUAL_ENV {venv}" in problem
    assert str(venv) not in problem.split(" runs ", 1)[1].split(" (head ", 1)[0]
