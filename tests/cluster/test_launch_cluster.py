"""`dtrain launch` across a cluster of network-namespace hosts, each with its own sshd.

After every scenario no process of the job may remain on any host within 10 s
(`ip netns pids`, minus the host's sshd daemon). The tests marked `CLIENTS` run once with
paramiko in the head and once with the system `ssh` client (--ssh-client openssh).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launcher.agent.progress import py_spy
from tests.support import PYTHON, REPO, dtrain_cmd, dtrain_env, run_dtrain, start_dtrain

PROBE = str(REPO / "tests" / "support" / "workers" / "probe.py")
CLIENTS = pytest.mark.parametrize("client", ["paramiko", "openssh"])


def _hostfile(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def _ssh(cluster, client: str = "paramiko") -> list[str]:
    return ["--ssh-config", str(cluster.ssh_config), "--ssh-client", client]


def _rank_json(stdout: str) -> dict[int, object]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("[") and "] " in line:
            tag, _, rest = line.partition("] ")
            out[int(tag[1:].split("@")[0])] = json.loads(rest)
    return out


@CLIENTS
def test_ranks_on_three_hosts_get_their_contract_and_their_host(cluster, tmp_path, client):
    hf = _hostfile(tmp_path, "node1 slots=2\nnode2 slots=1  # one GPU\nnode3:1\n")
    res = run_dtrain(["launch", "-f", hf, *_ssh(cluster, client), "--", PYTHON, PROBE, "env"])
    assert res.returncode == 0, res.stderr
    envs = _rank_json(res.stdout)
    expect = {0: ("node1", 0, 0, 2), 1: ("node1", 1, 0, 2), 2: ("node2", 0, 1, 1),
              3: ("node3", 0, 2, 1)}
    assert sorted(envs) == [0, 1, 2, 3]
    for rank, (host, local, node, local_size) in expect.items():
        e = envs[rank]
        assert e["hostname"] == e["DTRAIN_HOST"] == host
        assert (e["RANK"], e["LOCAL_RANK"], e["NODE_RANK"], e["LOCAL_WORLD_SIZE"]) == (
            str(rank), str(local), str(node), str(local_size))
        assert e["WORLD_SIZE"] == "4"
        assert e["MASTER_ADDR"] == cluster.address("node1")


def test_a_launch_over_the_ssh_client_never_imports_paramiko_on_the_head(cluster):
    res = subprocess.run([PYTHON, "-X", "importtime", *dtrain_cmd(
        ["launch", "-H", "node1:1,node2:1", *_ssh(cluster, "openssh"), "--", PYTHON, PROBE,
         "argv", "ok"])[1:]], capture_output=True, text=True, cwd=REPO, env=dtrain_env(),
        timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    assert list(_rank_json(res.stdout).values()) == [["ok"], ["ok"]]
    imported = {line.rpartition("|")[2].strip() for line in res.stderr.splitlines()
                if line.startswith("import time:")}
    assert "launcher.transport.openssh.session" in imported
    assert not {name for name in imported if name.split(".")[0] in ("paramiko", "cryptography")}


def test_awkward_arguments_arrive_byte_exact_over_ssh(cluster):
    awkward = ["a b", "'q'", '"dq"', "$(touch /tmp/dtrain-pwned-ssh)", "; echo x", "a\nb",
               "`id`", "", "ü", "$HOME", "\\n"]
    res = run_dtrain(["launch", "-H", "node2:1,node3:1", *_ssh(cluster), "--",
                      PYTHON, PROBE, "argv", *awkward])
    assert res.returncode == 0, res.stderr
    assert list(_rank_json(res.stdout).values()) == [awkward, awkward]
    assert not Path("/tmp/dtrain-pwned-ssh").exists()


def test_unknown_host_key_is_refused_with_its_fingerprint_and_nothing_starts(cluster, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    res = run_dtrain(["launch", "-H", "node1:1,node2:1", *_ssh(cluster), "--known-hosts",
                      str(empty), "--", PYTHON, PROBE, "sleep", "30"])
    assert res.returncode == 255
    assert "SHA256:" in res.stderr and "--ssh-accept-new" in res.stderr
    assert empty.read_text() == ""


def test_unknown_host_key_is_refused_by_the_ssh_client_and_nothing_starts(cluster, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    res = run_dtrain(["launch", "-H", "node1:1,node2:1", *_ssh(cluster, "openssh"),
                      "--known-hosts", str(empty), "--", PYTHON, PROBE, "sleep", "30"])
    assert res.returncode == 255, res.stderr
    [error] = res.stderr.splitlines()  # one error, printed once, for the host that failed first
    assert any(error.startswith(f"dtrain: error: host key of {host} ({cluster.address(host)}) "
                                f"is not known [root@{cluster.address(host)}:22]")
               for host in ("node1", "node2")), error
    assert "ssh-keyscan" in error and "--ssh-accept-new" in error
    assert res.stdout == "" and empty.read_text() == ""


@CLIENTS
def test_accept_new_records_unknown_host_keys_and_launches(cluster, tmp_path, client):
    known = tmp_path / "ssh" / "known_hosts"  # does not exist yet: dtrain creates it 0600
    args = ["launch", "-H", "node1:1,node2:1", *_ssh(cluster, client), "--known-hosts",
            str(known)]
    res = run_dtrain([*args, "--ssh-accept-new", "--", PYTHON, PROBE, "argv", "ok"])
    assert res.returncode == 0, res.stderr
    assert len(known.read_text().splitlines()) == 2
    assert known.stat().st_mode & 0o777 == 0o600
    again = run_dtrain([*args, "--", PYTHON, PROBE, "argv", "ok"])  # no flag: keys now known
    assert again.returncode == 0, again.stderr


def test_unreachable_host_is_retried_until_the_launch_timeout_and_starts_nothing(cluster,
                                                                               tmp_path):
    cluster.link_down("node3")
    t0 = time.monotonic()
    res = run_dtrain(["launch", "-H", "node1:1,node2:1,node3:1", *_ssh(cluster),
                      "--ssh-connect-timeout", "2", "--launch-timeout", "3", "--", PYTHON, PROBE,
                      "sleep", "30"])
    elapsed = time.monotonic() - t0
    assert res.returncode == 255
    assert "1 host(s) not reachable yet: node3 (TCP connect timed out" in res.stderr
    assert "nothing was started" not in res.stdout
    assert elapsed < 15
    assert not cluster.job_pids("node1") and not cluster.job_pids("node2")


@CLIENTS
def test_refused_port_gives_a_clear_error_once_the_launch_timeout_ends(cluster, tmp_path, client):
    hf = _hostfile(tmp_path, "node1 slots=1\nnode2 slots=1 port=2\n")
    t0 = time.monotonic()
    res = run_dtrain(["launch", "-f", hf, *_ssh(cluster, client), "--launch-timeout", "1", "--",
                      PYTHON, PROBE, "sleep", "30"])
    assert res.returncode == 255
    assert "refused" in res.stderr and "node2" in res.stderr
    assert time.monotonic() - t0 < 10


@CLIENTS
def test_failed_authentication_gives_a_clear_error(cluster, tmp_path, client):
    from testbed.sshd import keygen

    stranger = tmp_path / "stranger"
    keygen(stranger, "not-authorized")
    config = cluster.ssh_config.read_text().replace(str(cluster.client_key), str(stranger))
    (tmp_path / "ssh_config").write_text(config)
    res = run_dtrain(["launch", "-H", "node1:1", "--ssh-config", str(tmp_path / "ssh_config"),
                      "--ssh-client", client, "--", PYTHON, PROBE, "sleep", "30"])
    assert res.returncode == 255
    assert "node1" in res.stderr and "auth" in res.stderr.lower()


@CLIENTS
def test_a_failing_rank_on_one_host_stops_every_host(cluster, client):
    res = run_dtrain(["launch", "-H", "node1:2,node2:1,node3:1", *_ssh(cluster, client),
                      "--grace", "2", "--", PYTHON, PROBE, "fail", "2", "7"])
    assert res.returncode == 7
    assert "first failure: rank 2@node2: exited with code 7" in res.stderr


def test_a_rank_killed_by_a_signal_stops_every_host(cluster):
    res = run_dtrain(["launch", "-H", "node1:1,node2:1,node3:1", *_ssh(cluster), "--",
                      PYTHON, PROBE, "signal", "1", str(int(signal.SIGSEGV))])
    assert res.returncode == 139
    assert "rank 1@node2: killed by SIGSEGV" in res.stderr


def _start_sleeping_job(cluster, extra: list[str] = (), client: str = "paramiko") -> object:
    """Start 3 ranks (one per host) that each start a child, and wait until all are up.

    The pipe is read with `os.read`, not `readline` on the text file: that buffers every line
    of a read, and `select` on the descriptor then cannot see the lines left in the buffer (two
    ranks' lines arriving together were missed, and the job looked as if it never started).
    The deadline is generous: the tests are about what happens after the start."""
    head = start_dtrain(["launch", "-H", "node1:1,node2:1,node3:1", *_ssh(cluster, client),
                         *extra, "--", PYTHON, PROBE, "child", "120"])
    fd, seen, deadline = head.stdout.fileno(), b"", time.monotonic() + 60
    while seen.count(b"sleeping\n") < 3 and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.5)[0]:
            data = os.read(fd, 65536)
            if not data:
                break
            seen += data
    up = seen.count(b"sleeping\n")
    if up < 3:
        code = head.poll()  # None: still running, so the launch hangs rather than failed
        where = _stacks(head.pid) if code is None else ""
        head.kill()
        raise AssertionError(f"job did not start ({up} of 3 ranks up, head exit {code}): "
                             f"{seen.decode(errors='replace')}{head.communicate()}\n{where}")
    return head


def _stacks(pid: int) -> str:
    """Where a stuck head is, every thread (py-spy, found as the agent finds it)."""
    spy = py_spy()
    if spy is None:
        return "(no py-spy for the head's stacks)"
    done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                          timeout=30)
    return done.stdout + done.stderr


@CLIENTS
def test_ctrl_c_to_the_head_stops_every_host_with_exit_code_130(cluster, client):
    head = _start_sleeping_job(cluster, client=client)
    try:
        head.send_signal(signal.SIGINT)
        _, err = head.communicate(timeout=30)
        assert head.returncode == 130, err
    finally:
        head.kill()


@CLIENTS
def test_sigkill_of_the_head_leaves_nothing_on_any_host(cluster, client):
    head = _start_sleeping_job(cluster, client=client)
    head.kill()
    head.communicate(timeout=10)
    assert not cluster.wait_no_job_pids(10)


def test_a_host_whose_link_goes_down_is_detected_within_the_heartbeat_budget(cluster):
    head = _start_sleeping_job(cluster, ["--heartbeat-interval", "0.5", "--grace", "1"])
    try:
        cluster.link_down("node2")
        t0 = time.monotonic()
        _, err = head.communicate(timeout=30)
        detected = time.monotonic() - t0
        assert head.returncode == 255, err
        assert "host node2" in err and "no heartbeat" in err
        assert detected < 0.5 * 3 + 5
        # node2's agent misses the head's heartbeats and stops its ranks on its own.
        assert not cluster.wait_no_job_pids(10)
    finally:
        head.kill()


@pytest.mark.parametrize("start", ["together", "eager"])
def test_mpi_world_across_two_hosts_broadcasts_a_128_byte_id(cluster, start):
    code = ("from mpi4py import MPI; import hashlib, os\n"
            "c = MPI.COMM_WORLD\n"
            "uid = bytearray(os.urandom(128)) if c.rank == 0 else bytearray(128)\n"
            "c.Bcast(uid, root=0)\n"
            "import json; print(json.dumps([c.size, c.allreduce(c.rank + 1), "
            "hashlib.sha256(uid).hexdigest(), MPI.Get_processor_name()]))\n")
    res = run_dtrain(["launch", "-H", "node1:2,node2:2", *_ssh(cluster), "--start", start, "--",
                      PYTHON, "-c", code])
    assert res.returncode == 0, res.stderr
    got = _rank_json(res.stdout)
    assert sorted(got) == [0, 1, 2, 3]
    assert {tuple(v[:2]) for v in got.values()} == {(4, 10)}
    assert len({v[2] for v in got.values()}) == 1
    assert [got[r][3] for r in range(4)] == ["node1", "node1", "node2", "node2"]


def test_training_across_two_hosts_completes_and_its_loss_falls(cluster, tmp_path):
    run_dir = tmp_path / "run"
    res = run_dtrain(["launch", "-H", "node1:1,node2:1", *_ssh(cluster), "--", PYTHON, "-m",
                      "trainer.train", "--model", "tiny", "--steps", "40", "--log-every", "10",
                      "--data-cap-mb", "1", "--run-dir", str(run_dir)], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) >= 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    assert "dp 2" in res.stdout + res.stderr


def test_an_unmodified_torch_env_script_runs_across_hosts(cluster):
    script = str(REPO / "tests" / "support" / "workers" / "torch_env_script.py")
    res = run_dtrain(["launch", "-H", "node1:1,node3:1", *_ssh(cluster), "--", PYTHON, script],
                     timeout=120)
    assert res.returncode == 0, res.stderr
    assert "rank 1 of 2 sum 3" in res.stdout


def test_diagnose_reports_mpi_and_bandwidth_across_hosts(cluster):
    res = run_dtrain(["launch", "-H", "node1:2,node2:2", *_ssh(cluster), "--", PYTHON, "-m",
                      "trainer.diagnose", "--sizes", "1K,64K", "--iters", "3"], timeout=180)
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    assert "MPICH" in out and "node2" in out


def test_a_job_on_the_head_and_a_remote_host_forms_one_world(cluster):
    code = ("from mpi4py import MPI; import json, os; c = MPI.COMM_WORLD\n"
            "print(json.dumps([os.environ['MASTER_ADDR'], MPI.Get_processor_name(), "
            "c.allreduce(c.rank)]))\n")
    res = run_dtrain(["launch", "-H", "localhost:2,node1:2", *_ssh(cluster), "--", PYTHON, "-c",
                      code])
    assert res.returncode == 0, res.stderr
    got = _rank_json(res.stdout)
    # Rank 0 runs on the head: its address towards node1 is the head's bridge address.
    assert {v[0] for v in got.values()} == {cluster.head_address}
    assert got[2][1] == got[3][1] == "node1" and {v[2] for v in got.values()} == {6}


def test_3d_training_across_two_hosts_completes_and_its_loss_falls(cluster, tmp_path):
    run_dir = tmp_path / "run3d"
    res = run_dtrain(["launch", "-H", "node1:4,node2:4", *_ssh(cluster), "--", PYTHON, "-m",
                      "trainer.train", "--model", "tiny", "--dp", "2", "--tp", "2", "--pp", "2",
                      "--microbatches", "2", "--steps", "30", "--log-every", "10",
                      "--data-cap-mb", "1", "--run-dir", str(run_dir)], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) >= 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3
