"""`dtrain check`: the preflight table, locally and across namespace hosts."""

from __future__ import annotations

import sys

from launcher.check import check_hosts, compare
from launcher.launch import HostRequest, select
from launcher.transport.options import SSHOptions
from tests.support import REPO, run_dtrain

HEAD = {"python": "3.11.7", "dtrain": "0.1.0",
        "versions": {"torch": "2.13.0", "mpi4py": "4.1.2", "mpich": "5.0.2"}}


def test_compare_names_every_difference_a_user_can_fix():
    remote = {"python": "3.10.1", "dtrain": "0.1.0", "gpus": 2, "cwd_exists": False,
              "versions": {"torch": "2.12.0", "mpi4py": "4.1.2", "mpich": None}}
    problems = compare(HEAD, remote, slots=4)
    assert problems == ["python 3.10.1 (head 3.11.7)", "torch 2.12.0 (head 2.13.0)",
                        "mpich missing (head 5.0.2)", "4 slots but nvidia-smi lists 2 GPUs",
                        "working directory missing"]
    assert compare(HEAD, {**HEAD, "gpus": None, "cwd_exists": True}, slots=8) == []


def test_compare_flags_a_host_whose_python_is_not_the_heads():
    head = {**HEAD, "rank_python": "/v/bin/python"}
    same = {**head, "cwd_exists": True, "missing_prefixes": []}
    assert compare(head, same, slots=1) == []
    elsewhere = {**same, "rank_python": "/usr/bin/python", "missing_prefixes": ["VIRTUAL_ENV /v"]}
    assert compare(head, elsewhere, slots=1) == [
        "`python` runs /usr/bin/python (head /v/bin/python); missing here: VIRTUAL_ENV /v"]
    assert compare(head, {**same, "rank_python": None}, slots=1) == [
        "`python` runs no python (head /v/bin/python)"]


def test_check_of_localhost_passes():
    res = run_dtrain(["check", "--nproc-per-node", "2"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "localhost" in res.stdout and "ok" in res.stdout


def test_check_across_hosts_reports_each_host_and_its_latency(netns_cluster):
    res = run_dtrain(["check", "-H", "node1:2,node2:2,node3:1", "--ssh-config",
                      str(netns_cluster.ssh_config)])
    assert res.returncode == 0, res.stdout + res.stderr
    for host in ("node1", "node2", "node3"):
        assert host in res.stdout
    assert "local" not in res.stdout.split("ssh ms", 1)[1]  # a latency figure, not "local"


def test_check_hosts_takes_ssh_options_and_times_only_the_ssh_hosts(netns_cluster):
    rows = check_hosts(select(HostRequest(hosts="node1:1,localhost:1")),
                       ssh=SSHOptions(config_file=netns_cluster.ssh_config),
                       python=sys.executable, cwd=str(REPO))
    assert [r.host for r in rows] == ["node1", "localhost"]
    assert [r.problems for r in rows] == [[], []]
    assert rows[0].latency_ms is not None and rows[0].latency_ms > 0
    assert rows[1].latency_ms is None


def test_check_fails_when_a_host_is_unreachable_and_names_it(netns_cluster):
    netns_cluster.link_down("node3")
    try:
        res = run_dtrain(["check", "-H", "node1:1,node3:1", "--ssh-config",
                          str(netns_cluster.ssh_config), "--ssh-connect-timeout", "1.5"])
    finally:
        netns_cluster.link_up("node3")
    assert res.returncode == 1
    assert "problems on 1 of 2 hosts: node3" in res.stderr


def test_check_fails_when_the_working_directory_is_missing(tmp_path):
    res = run_dtrain(["check", "--chdir", str(tmp_path / "nowhere")])
    assert res.returncode == 1
    assert "working directory missing" in res.stdout
