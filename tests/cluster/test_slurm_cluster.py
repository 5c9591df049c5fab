"""`dtrain launch` and `dtrain check` inside allocations of a real Slurm (testbed/slurm.py).

The nodes run slurmd and no sshd; each test asks `salloc` for 2 or 3 nodes and runs dtrain
as the allocation's command, as a user on the login node would. After every scenario no
process of the job may remain on any node within 10 s (`ip netns pids`, minus slurmd).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launcher.hosts.hostfile import HostEntry
from launcher.hosts.selection import HostSlots
from launcher.slurm.srun import SrunAgentStream, start_agents
from tests.support import (
    DTRAIN_SCRIPT,
    PYTHON,
    REPO,
    dtrain_cmd,
    dtrain_env,
    imposters_imported,
    kill_recorded,
    plant_imposters,
)

PROBE = str(REPO / "tests" / "support" / "workers" / "probe.py")
MPI_CODE = ("from mpi4py import MPI; import json; c = MPI.COMM_WORLD\n"
            "print(json.dumps([c.size, c.allreduce(c.rank + 1), MPI.Get_processor_name()]))\n")


@pytest.fixture
def slurm(slurm_cluster):
    yield slurm_cluster
    for host in slurm_cluster.hosts:
        if slurm_cluster.slurmd_pid(host) is None:
            slurm_cluster.start_slurmd(host)
    left = slurm_cluster.wait_no_job_pids(10)
    assert not left, f"job processes left on nodes: {left}"
    slurm_cluster.wait_idle(slurm_cluster.hosts, timeout=30)


def _salloc(slurm, nodes: int, tasks: int, args: list[str]) -> list[str]:
    return ["salloc", f"--nodes={nodes}", f"--ntasks-per-node={tasks}", "--quiet", "--",
            *dtrain_cmd(args)]


def _run(slurm, nodes: int, tasks: int, args: list[str], timeout: float = 120
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_salloc(slurm, nodes, tasks, args), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=_env(slurm))


def _env(slurm) -> dict[str, str]:
    return dtrain_env({"SLURM_CONF": str(slurm.conf)})


def _rank_json(stdout: str) -> dict[int, object]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("[") and "] " in line:
            tag, _, rest = line.partition("] ")
            out[int(tag[1:].split("@")[0])] = json.loads(rest)
    return out


def test_in_an_allocation_without_a_hostfile_every_rank_gets_its_contract_on_its_node(slurm):
    res = _run(slurm, 2, 2, ["launch", "--launcher", "slurm", "--", PYTHON, PROBE, "env"])
    assert res.returncode == 0, res.stderr
    envs = _rank_json(res.stdout)
    assert sorted(envs) == [0, 1, 2, 3]
    for rank, e in envs.items():
        host = f"node{rank // 2 + 1}"
        assert e["hostname"] == e["DTRAIN_HOST"] == host
        assert (e["RANK"], e["LOCAL_RANK"], e["NODE_RANK"], e["LOCAL_WORLD_SIZE"],
                e["WORLD_SIZE"]) == (str(rank), str(rank % 2), str(rank // 2), "2", "4")
        assert e["MASTER_ADDR"] == slurm.netns.address("node1")
        assert e["scrubbed"] == []  # Slurm's own SLURM_* variables do not reach the ranks


def test_an_sbatch_job_runs_the_head_on_its_first_node_and_every_rank_on_its_own(slurm,
                                                                                   tmp_path):
    out = tmp_path / "job.out"
    script = shlex.join([*dtrain_cmd(["launch", "--launcher", "slurm", "--", PYTHON, PROBE,
                                      "env"])])
    done = subprocess.run(["sbatch", "--wait", "--nodes=2", "--ntasks-per-node=1",
                           f"--output={out}", f"--chdir={REPO}", "--wrap", script],
                          capture_output=True, text=True, timeout=120, env=_env(slurm))
    assert done.returncode == 0, out.read_text() if out.exists() else done.stderr
    envs = _rank_json(out.read_text())
    assert {r: e["hostname"] for r, e in envs.items()} == {0: "node1", 1: "node2"}
    assert envs[1]["MASTER_ADDR"] == slurm.netns.address("node1")


def test_launcher_slurm_forms_one_mpi_world_across_nodes_that_run_no_ssh_server(slurm):
    assert all(slurm.netns.sshd_pid(h) is None for h in slurm.hosts)
    res = _run(slurm, 3, 1, ["launch", "--launcher", "slurm", "--", PYTHON, "-c", MPI_CODE])
    assert res.returncode == 0, res.stderr
    got = _rank_json(res.stdout)
    assert [got[r] for r in range(3)] == [[3, 6, "node1"], [3, 6, "node2"], [3, 6, "node3"]]


def test_srun_agents_never_import_from_the_launch_directory_they_start_in(slurm, tmp_path):
    # slurmstepd starts each step in srun's working directory: here one holding imposters.
    shared = plant_imposters(tmp_path)
    argv = ["salloc", "--nodes=2", "--ntasks-per-node=1", "--quiet", "--", DTRAIN_SCRIPT,
            "launch", "--launcher", "slurm", "--", PYTHON, "-c", "print('ran')"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=shared,
                         env=_env(slurm))
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("ran") == 2
    assert imposters_imported(shared) == []


def test_a_failing_rank_ends_the_job_with_its_exit_code_and_stops_every_node(slurm):
    res = _run(slurm, 2, 2, ["launch", "--launcher", "slurm", "--", PYTHON, PROBE,
                             "fail", "3", "7"])
    assert res.returncode == 7, res.stderr
    assert "first failure: rank 3@node2: exited with code 7" in res.stderr


def _start_sleeping_job(slurm, pid_dir: Path) -> subprocess.Popen[str]:
    head = subprocess.Popen(
        _salloc(slurm, 2, 2, ["launch", "--launcher", "slurm", "--heartbeat-interval", "1",
                              "--env", f"PROBE_PID_DIR={pid_dir}", "--",
                              PYTHON, PROBE, "sleep", "120"]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env=_env(slurm))
    deadline = time.monotonic() + 60
    while len(list(pid_dir.glob("*.pid"))) < 4:
        if time.monotonic() > deadline or head.poll() is not None:
            kill_recorded([head.pid])
            pytest.fail(f"the job did not start: {head.communicate()[1][-2000:]}")
        time.sleep(0.1)
    return head


def _job_id(slurm) -> str:
    return slurm.run("squeue", "--noheader", "--format=%i").stdout.split()[0]


def test_scancel_ends_the_job_with_143_and_says_that_slurm_cancelled_it(slurm, tmp_path):
    head = _start_sleeping_job(slurm, tmp_path)
    job = _job_id(slurm)
    slurm.run("scancel", job)
    _, err = head.communicate(timeout=60)
    assert head.returncode == 143, err
    assert err.count(f"Slurm ended the job [Slurm job {job}: CANCELLED") == 1


def test_a_node_whose_slurmd_dies_ends_the_job_with_255_naming_the_node(slurm, tmp_path):
    head = _start_sleeping_job(slurm, tmp_path)
    slurm.kill_slurmd("node2")
    _, err = head.communicate(timeout=90)
    assert head.returncode == 255, err
    assert "first failure: host node2" in err and "Node failure on node2" in err


def _agent_pid(slurm, host: str) -> int:
    for pid in slurm.job_pids(host):
        try:
            if b"launcher.agent" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise AssertionError(f"no agent process on {host}")


def test_killing_an_srun_stream_ends_its_step_even_when_the_agent_hangs(slurm):
    alloc = slurm.run("salloc", "--nodes=1", "--no-shell")  # "Granted job allocation N"
    job = alloc.stderr.split("Granted job allocation")[1].split()[0]
    try:
        entry = HostEntry("node1", 1)
        [stream] = start_agents([HostSlots(entry, (0,), False)], python=PYTHON,
                                environ={**_env(slurm), "SLURM_JOB_ID": job})
        assert isinstance(stream, SrunAgentStream)
        assert stream.read(1)  # the agent's HELLO began: it runs on node1
        os.kill(_agent_pid(slurm, "node1"), signal.SIGSTOP)  # hung: it cannot act on EOF
        stream.close()
        stream.kill()  # srun SIGKILLed: only Slurm terminating the step ends a stopped agent
        assert stream.wait(10) is not None
        assert not slurm.wait_no_job_pids(10)
    finally:
        slurm.run("scancel", job, check=False)


def test_dtrain_check_under_slurm_checks_every_node_through_srun(slurm):
    res = _run(slurm, 3, 1, ["check", "--launcher", "slurm"])
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith("│ node")]
    assert [row.split("│")[2].strip() for row in rows] == ["node1", "node2", "node3"]
    assert all(row.rstrip("│ ").endswith("ok") for row in rows)


def test_dp2_tp2_training_under_launcher_slurm_completes_and_its_loss_falls(slurm, tmp_path):
    run_dir = tmp_path / "run"
    res = _run(slurm, 2, 2, ["launch", "--launcher", "slurm", "--", PYTHON, "-m",
                             "trainer.train", "--model", "tiny", "--dp", "2", "--tp", "2",
                             "--steps", "30", "--log-every", "10", "--data-cap-mb", "1",
                             "--run-dir", str(run_dir)], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) >= 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3


def test_a_node_whose_slurmd_dies_is_replaced_by_the_spare_node_and_training_resumes(
        slurm, tmp_path):
    """salloc --no-kill keeps the allocation when a node fails; the last node stands by
    (--spares 1) and its srun step takes the failed node's place. UCX_TLS=tcp: the ranks'
    traffic takes the network, as between real nodes (see tests/cluster/test_restart_cluster.py)."""
    run_dir = tmp_path / "run"
    train = [PYTHON, "-m", "trainer.train", "--model", "tiny", "--n-layer", "1", "--d-model",
             "32", "--seq-len", "32", "--global-batch", "4", "--warmup-steps", "1",
             "--steps", "1000000", "--time-limit", "25", "--log-every", "50", "--eval-every",
             "0", "--save-every", "50",
             "--data-cap-mb", "0.25", "--run-dir", str(run_dir)]
    head = subprocess.Popen(
        ["salloc", "--nodes=3", "--ntasks-per-node=1", "--no-kill", "--quiet", "--",
         *dtrain_cmd(["launch", "--launcher", "slurm", "--spares", "1", "--max-restarts", "1",
                      "--heartbeat-interval", "0.5", "--grace", "3", "--restart-backoff", "0",
                      "--env", "UCX_TLS=tcp", "--", *train])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env(slurm))
    try:
        deadline = time.monotonic() + 120
        # Slurm needs SlurmdTimeout (5 s) and more to call the node failed, however fast the
        # steps are: each round trains for 25 s (--time-limit; the clock starts with a round).
        while not (run_dir / "checkpoints" / "step-50" / "COMMITTED").exists():
            if time.monotonic() > deadline or head.poll() is not None:
                pytest.fail(f"training did not start: {head.communicate(timeout=30)[1][-3000:]}")
            time.sleep(0.1)
        slurm.kill_slurmd("node2")
        out, err = head.communicate(timeout=240)
    finally:
        kill_recorded([head.pid])
    assert head.returncode == 0, err[-3000:]
    assert "node3 replaces node2" in err
    said = out + err
    assert "after restart 1 (cause: host lost: node2)" in said
    resumed = int(said.split("resumed at step ")[1].split()[0])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert resumed >= 50 and [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert len(rows) > resumed  # the spare's round trained on from the checkpoint
