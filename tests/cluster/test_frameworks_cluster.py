"""Scripts written for other launchers run unchanged under `dtrain launch` on 2 network-namespace
hosts x 2 ranks: a Lightning Fabric CPU DDP script and an Accelerate script see world size 4 and
their ranks, and print the same per-step losses as under torchrun run on the same hosts (one
`torchrun --nnodes 2` per host, static rendezvous at node1); a DeepSpeed script gets
DS_ACCELERATOR from the head's environment without --env.

The frameworks are the real packages (the `dev` extra); the scripts are in tests/support/workers/.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support import PYTHON, REPO, dtrain_env, kill_recorded, run_dtrain, stop_trees

WORKERS = REPO / "tests" / "support" / "workers"
# A port per script: the netns hosts live for the whole session, and a closed store's port
# may linger in TIME_WAIT.
TORCHRUN_PORTS = {"fabric_ddp.py": 29511, "accelerate_train.py": 29512}


def _records(stdout: str) -> list[dict]:
    """The JSON lines the scripts print, under dtrain's [rank@host] prefix or torchrun's none."""
    out = []
    for line in stdout.splitlines():
        text = line.partition("] ")[2] if line.startswith("[") else line
        if text.startswith("{"):
            out.append(json.loads(text))
    return out


def _dtrain(cluster, script: str, *args: str, env: dict[str, str] | None = None) -> list[dict]:
    res = run_dtrain(["launch", "-H", "node1:2,node2:2", "--ssh-config", str(cluster.ssh_config),
                      "--", PYTHON, str(WORKERS / script), *args], timeout=240, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return _records(res.stdout)


def _torchrun(cluster, script: str, *args: str) -> list[dict]:
    """One torchrun per host, in the host's namespace, as its users start a 2-node job. The
    reference is the peer's run, not the subject: one that hangs (seen once, 2026-11-27: the
    torchrun pair never finished; the test then kept none of its output) is stopped and
    started once more on another port; a second hang fails the test with both hosts' output."""
    seen = []
    for attempt in range(2):
        outs = _torchrun_once(cluster, TORCHRUN_PORTS[script] + 100 * attempt, script, *args)
        if isinstance(outs, list):
            return outs
        seen.append(outs)
    pytest.fail("torchrun's reference run hung twice:\n" + "\n".join(seen))


def _torchrun_once(cluster, port: int, script: str, *args: str) -> list[dict] | str:
    """The records of one reference run, or what its hosts printed when it hung (every process
    it started is stopped: the recorded torchruns and their children)."""
    procs = []
    env = dtrain_env({"GLOO_SOCKET_IFNAME": "eth0"})  # torchrun leaves the interface to gloo
    try:
        for node, host in enumerate(("node1", "node2")):
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", cluster.namespace(host), PYTHON, "-m",
                 "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                 "--node-rank", str(node), "--master-addr", cluster.address("node1"),
                 "--master-port", str(port), str(WORKERS / script), *args],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO))
        outs = [p.communicate(timeout=120) for p in procs]
    except subprocess.TimeoutExpired:
        stop_trees([p.pid for p in procs])
        return "\n".join(f"host {n + 1}: {err[-1500:]}" for n, (_, err) in
                         enumerate(p.communicate() for p in procs))
    finally:
        kill_recorded([p.pid for p in procs if p.poll() is None])
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [r for out, _ in outs for r in _records(out)]


def _losses(records: list[dict]) -> dict[int, float]:
    """step -> the loss averaged over every rank, which each rank printed alike."""
    by_step: dict[int, set[float]] = {}
    for r in records:
        by_step.setdefault(r["step"], set()).add(r["loss"])
    assert all(len(v) == 1 for v in by_step.values()), by_step
    return {step: v.pop() for step, v in sorted(by_step.items())}


def _ranks_and_world(records: list[dict]) -> set[tuple[int, int]]:
    return {(r["rank"], r["world"]) for r in records}


def test_an_unmodified_lightning_fabric_script_sees_its_ranks_and_the_losses_of_torchrun(
        cluster):
    """Fabric takes its torchrun path (TorchElasticEnvironment, by TORCHELASTIC_RUN_ID) rather
    than its MPI mode, which mpi4py and dtrain's PMI world would otherwise select."""
    args = ("--devices", "2", "--num-nodes", "2")
    ours = _dtrain(cluster, "fabric_ddp.py", *args)
    assert _ranks_and_world(ours) == {(r, 4) for r in range(4)}
    assert {(r["rank"], r["node"], r["local"]) for r in ours} == {
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)}
    assert {r["env"] for r in ours} == {"TorchElasticEnvironment"}
    theirs = _torchrun(cluster, "fabric_ddp.py", *args)
    # The same gloo ring over the same ranks and data: the same float32 sums, bit for bit.
    assert _losses(ours) == _losses(theirs) and len(_losses(ours)) == 4


def test_an_unmodified_accelerate_script_sees_its_ranks_and_the_losses_of_torchrun(cluster):
    ours = _dtrain(cluster, "accelerate_train.py")
    assert _ranks_and_world(ours) == {(r, 4) for r in range(4)}
    assert {(r["rank"], r["local"]) for r in ours} == {(0, 0), (1, 1), (2, 0), (3, 1)}
    assert {r["type"] for r in ours} == {"DistributedType.MULTI_CPU"}
    theirs = _torchrun(cluster, "accelerate_train.py")
    assert _losses(ours) == _losses(theirs) and len(_losses(ours)) == 4


@pytest.mark.parametrize(("built", "left"), [
    ("plain", []), ("ddp", ["gloo_tcp_loop", "pt_gloo_runloop", "pt_gloo_runloop"])])
def test_gloo_threads_outlive_destroy_process_group_once_torch_built_a_ddp_model(
        built: str, left: list[str]) -> None:
    """Why the Fabric and Accelerate scripts leave with os._exit: with a DDP model built (and
    freed) torch 2.13 keeps the gloo group's threads after destroy_process_group, and they race
    the interpreter's teardown (tests/support/workers/accelerate_train.py). When torch stops doing
    so
    this test fails, and the scripts can end as their users' do."""
    res = subprocess.run([PYTHON, str(WORKERS / "gloo_threads.py"), built], capture_output=True,
                         text=True, timeout=120, env=dtrain_env())
    assert res.returncode == 0, res.stderr[-3000:]
    threads = json.loads(res.stdout.splitlines()[-1])
    assert [t for t in threads if t != "python"] == left


def test_a_deepspeed_script_gets_ds_accelerator_from_the_heads_environment(cluster):
    ours = _dtrain(cluster, "deepspeed_accel.py", env={"DS_ACCELERATOR": "cpu"})
    assert _ranks_and_world(ours) == {(r, 4) for r in range(4)}
    assert {(r["DS_ACCELERATOR"], r["accelerator"], r["sum"]) for r in ours} == {
        ("cpu", "cpu", 6.0)}
