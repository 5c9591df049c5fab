"""Restarts across a cluster of network-namespace hosts (`dtrain launch --max-restarts`): real
sshd, real MPICH ranks, real training where the numbers matter.

After every scenario no process of the job may remain on any host within 10 s, a host whose
link was cut included once its link is back (`ip netns pids`, minus the host's sshd). The
scenarios that only need ranks to fail or sleep run `tests/support/workers/restart_worker.py` (no
torch: milliseconds per rank); those about resuming train the tiny model for real, and the
bit-for-bit comparisons share one uninterrupted reference run on the same three hosts (the
same layout on the same hosts reduces in the same order).

The namespace hosts share one kernel, and UCX (MPICH's transport here) would carry the ranks'
traffic between them through shared memory, under a cut link; ``UCX_TLS=tcp`` makes it take
the network, as between real hosts, so a cut link stops the collectives as it would there.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.support import PYTHON, REPO, report_table, run_dtrain, start_dtrain
from tests.support.numerics import U32, f64, reduction_rtol
from tests.support.serial_reference import bounds, train_serially
from trainer.checkpoint import step_dirs
from trainer.checkpoint.pieces import assemble
from trainer.config.options import make_config

WORKER = str(REPO / "tests" / "support" / "workers" / "restart_worker.py")
THREE = "node1 slots=1\nnode2 slots=1\nnode3 slots=1\n"
# Detection of a cut link within 1.5 s; ranks stuck with a dead peer leave after their
# SIGTERM watchdog (about 1 s for these steps) or the grace.
NETWORK = ["--env", "UCX_TLS=tcp"]  # see the module docstring
FAST = ["--heartbeat-interval", "0.5", "--grace", "3", "--restart-backoff", "0"]
STEPS = 60  # ~1-2 s of steps after the failure: it strikes mid-run, not after the last step
MODEL = {"model": "tiny", "n_layer": 1, "d_model": 32, "seq_len": 32, "warmup_steps": 1,
         "data_cap_mb": 0.25, "eval_every": 0, "log_every": 1, "save_every": 4}


class Head:
    """`dtrain launch` running, its stdout and stderr collected line by line as they come."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = start_dtrain(args, env=env)
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [threading.Thread(target=self._read, args=(pipe, lines), daemon=True)
                         for pipe, lines in ((self.proc.stdout, self.out),
                                             (self.proc.stderr, self.err))]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _read(pipe, lines: list[str]) -> None:
        for line in pipe:
            lines.append(line)

    def wait_for(self, found, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not found():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.finish()
                raise AssertionError(f"never came (head exit {self.proc.returncode}):\n"
                                     f"{''.join(self.out)[-3000:]}\n{''.join(self.err)[-3000:]}")
            time.sleep(0.05)

    def finish(self, timeout: float = 240) -> tuple[int, str, str]:
        try:
            self.proc.wait(timeout)
        finally:
            self.proc.kill()
        for thread in self._threads:
            thread.join(10)
        return self.proc.returncode, "".join(self.out), "".join(self.err)


def _args(cluster, hostfile: Path, *extra: str) -> list[str]:
    return ["launch", "-f", str(hostfile), "--ssh-config", str(cluster.ssh_config), *NETWORK,
            *extra]


def _hostfile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


def _rounds(stdout: str) -> list[dict]:
    """The JSON lines of restart_worker: one per rank and round."""
    return [json.loads(line.partition("] ")[2]) for line in stdout.splitlines()
            if line.startswith("[") and '"round"' in line]


def _rank_pid(cluster, host: str, needle: str) -> int:
    for pid in cluster.job_pids(host):
        try:
            if needle.encode() in Path(f"/proc/{pid}/cmdline").read_bytes() and b"launcher" \
                    not in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise AssertionError(f"no {needle} process on {host}")


def _row(stderr: str, round_no: int) -> str:
    """The rounds table's row of a failed round."""
    return next(line for line in stderr.splitlines()
                if line.startswith(f"dtrain: {round_no} ") and "  " in line)


# -- failures without training ------------------------------------------------------------
def test_a_rank_killed_by_sigkill_restarts_the_job_on_the_same_hosts(cluster, tmp_path):
    head = Head(_args(cluster, _hostfile(tmp_path, THREE), "--max-restarts", "1", *FAST,
                      "--", PYTHON, WORKER, "sleep-first"))
    head.wait_for(lambda: "".join(head.out).count("up\n") == 3)
    os.kill(_rank_pid(cluster, "node2", "restart_worker.py"), signal.SIGKILL)
    code, out, err = head.finish()
    assert code == 0, err
    again = {r["rank"]: r["host"] for r in _rounds(out) if r["round"] == 1}
    assert again == {0: "node1", 1: "node2", 2: "node3"}
    row = _row(err, 0)
    assert "rank killed by SIGKILL" in row and "node2" in row and "same hosts" in row


@pytest.mark.parametrize("code, budget, why", [
    (2, 3, "not restarting: exit code 2 is permanent (--no-restart-on 2)"),
    (3, 1, "not restarting: the restart budget is spent (1 of --max-restarts 1)"),
], ids=["bad-flag", "budget-spent"])
def test_a_bad_flag_is_never_restarted_and_a_spent_budget_ends_with_the_last_code(
        cluster, tmp_path, code, budget, why):
    res = run_dtrain(_args(cluster, _hostfile(tmp_path, THREE), "--max-restarts", str(budget),
                           *FAST, "--", PYTHON, WORKER, "fail", "1", str(code)), timeout=120)
    assert res.returncode == code, res.stderr
    assert why in res.stderr
    rounds = {r["round"] for r in _rounds(res.stdout)}
    assert rounds == ({0} if code == 2 else {0, 1})
    if code == 3:  # the per-round table: both rounds failed the same way
        assert f"rank exited {code}" in _row(res.stderr, 0)
        assert f"rank exited {code}" in _row(res.stderr, 1)


def test_ctrl_c_during_the_back_off_ends_with_130_and_leaves_nothing(cluster, tmp_path):
    head = Head(_args(cluster, _hostfile(tmp_path, THREE + "node4 slots=1 spare\n"),
                      "--max-restarts", "2", "--heartbeat-interval", "0.5", "--grace", "1",
                      "--restart-backoff", "60", "--", PYTHON, WORKER, "fail", "1", "3"))
    head.wait_for(lambda: "restart 1 of 2 in 60s" in "".join(head.err))
    t0 = time.monotonic()
    head.proc.send_signal(signal.SIGINT)
    code, _, err = head.finish()
    assert code == 130, err
    assert time.monotonic() - t0 < 10


def test_a_hung_rank_under_hang_action_abort_has_its_host_blamed_and_replaced(cluster,
                                                                             tmp_path):
    res = run_dtrain(_args(cluster, _hostfile(tmp_path, THREE + "node4 slots=1 spare\n"),
                           "--max-restarts", "1", *FAST, "--hang-timeout", "3",
                           "--hang-action", "abort", "--", PYTHON, WORKER, "hang", "2"),
                     timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    row = _row(res.stderr, 0)
    assert "hang" in row and "node3" in row and "node4 replaces node3" in row
    again = {r["rank"]: r["host"] for r in _rounds(res.stdout) if r["round"] == 1}
    assert again == {0: "node1", 1: "node2", 2: "node4"}


# A loaded host: its agent's interpreter starts 2.5 s after the SSH session does (longer than
# the 1.5 s a host may stay silent under --heartbeat-interval 0.5). What the head sends each
# agent is kept in <folder>/<host address>.in (a tee beside the agent, not its child: the
# agent stops its descendants with its ranks), to see which hosts were sent what.
SLOW_BOOT = """#!/bin/bash
read -r _ _ address _ <<< "$SSH_CONNECTION"
sleep 2.5
tee "{folder}/$address.in" | {python} "$@"
"""
SECRET = "hf_cluster0123456789abcdef"  # the user's HF_TOKEN on the head, forwarded (HF_)


def _agent_pid(cluster, host: str, timeout: float = 30.0) -> int:
    """The agent's interpreter on ``host`` (not the wrapper that started it), once it runs: a
    spare's agent may still be starting when the other hosts' ranks are up."""
    deadline = time.monotonic() + timeout
    while True:
        for pid in cluster.job_pids(host):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[0] == PYTHON.encode() and b"launcher.agent" in argv:
                return pid
        if time.monotonic() > deadline:
            raise AssertionError(f"no agent on {host} within {timeout:.0f} s")
        time.sleep(0.1)


def test_spares_slow_to_boot_stay_take_a_place_and_never_receive_the_secrets(cluster,
                                                                            tmp_path):
    folder = tmp_path / "sent"
    folder.mkdir()
    wrapper = tmp_path / "slow-python"
    wrapper.write_text(SLOW_BOOT.format(folder=folder, python=PYTHON))
    wrapper.chmod(0o755)
    hosts = "node1 slots=1\nnode2 slots=1\nnode3 slots=1 spare\nnode4 slots=1 spare\n"
    head = Head(_args(cluster, _hostfile(tmp_path, hosts), "--max-restarts", "1", *FAST,
                      "--remote-python", str(wrapper), "--", PYTHON, WORKER, "sleep-first"),
                env={"HF_TOKEN": SECRET})
    try:
        head.wait_for(lambda: "".join(head.out).count("up\n") == 2)
        time.sleep(1.0)  # the spares have said nothing for longer than 1.5 s by now
        os.kill(_agent_pid(cluster, "node2"), signal.SIGKILL)  # node2 is lost
        code, _, err = head.finish()
    finally:
        head.proc.kill()  # a failed step: its agents leave when the head is gone
    assert code == 0, err[-3000:]
    assert "host lost" in _row(err, 0) and "node3 replaces node2" in _row(err, 0)
    assert "spare node" not in err  # neither spare was lost
    sent = {host: (folder / f"{cluster.address(host)}.in").read_bytes()
            for host in ("node1", "node3", "node4")}
    assert b'"check_env"' in sent["node4"]  # node4 checked the job ...
    assert SECRET.encode() not in sent["node4"]  # ... and was never sent the secret
    assert SECRET.encode() in sent["node1"] and SECRET.encode() in sent["node3"]  # they ran


def test_a_spare_that_stalls_is_said_lost_once_and_connected_again_to_take_a_place(cluster,
                                                                                   tmp_path):
    hosts = "node1 slots=1\nnode2 slots=1\nnode3 slots=1 spare\n"
    head = Head(_args(cluster, _hostfile(tmp_path, hosts), "--max-restarts", "1", *FAST,
                      "--", PYTHON, WORKER, "sleep-first"))
    try:
        head.wait_for(lambda: "".join(head.out).count("up\n") == 2)
        stalled = _agent_pid(cluster, "node3")
        os.kill(stalled, signal.SIGSTOP)  # a stall longer than the 1.5 s a host may be silent
        try:
            head.wait_for(lambda: "spare node3 lost" in "".join(head.err), timeout=30)
        finally:
            os.kill(stalled, signal.SIGCONT)  # it finds its stream closed and leaves
        os.kill(_agent_pid(cluster, "node2"), signal.SIGKILL)  # node2 is lost: node3's turn
        code, _, err = head.finish()
    finally:
        head.proc.kill()  # a failed step: its agents leave when the head is gone
    assert code == 0, err[-3000:]
    assert "node3 replaces node2" in _row(err, 0)
    [lost] = [line for line in err.splitlines() if "spare node3 lost" in line]
    assert lost.startswith("dtrain: spare node3 lost: no heartbeat for ")
    assert err.count("dtrain: spare node3 is back (connected again)\n") == 1


# -- real training ------------------------------------------------------------------------
def _train(run_dir: Path, **options) -> list[str]:
    flags = {**MODEL, "global_batch": 6, "steps": STEPS, "run_dir": str(run_dir), **options}
    return [PYTHON, "-m", "trainer.train",
            *[item for key, value in flags.items()
              for item in ((f"--{key.replace('_', '-')}",) if value is True else
                           (f"--{key.replace('_', '-')}", str(value)))]]


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return assemble(run_dir / "checkpoints" / f"step-{STEPS}")


def _saved(run_dir: Path, step: int):
    """True once the checkpoint of ``step`` is committed (metrics.jsonl is written in blocks,
    so it lags; a checkpoint is on disk the moment it counts)."""
    return lambda: (run_dir / "checkpoints" / f"step-{step}" / "COMMITTED").exists()


@pytest.fixture(scope="module")
def reference(netns_cluster, tmp_path_factory):
    """The uninterrupted run on node1..node3, dp 3: its losses and final parameters."""
    run_dir = tmp_path_factory.mktemp("reference")
    res = run_dtrain(["launch", "-H", "node1:1,node2:1,node3:1", "--ssh-config",
                      str(netns_cluster.ssh_config), *NETWORK, "--", *_train(run_dir)],
                     timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return _losses(run_dir), _final_params(run_dir)


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_cut_host_is_replaced_by_the_spare_and_the_run_ends_bit_for_bit(cluster, tmp_path,
                                                                          reference):
    want_losses, want_params = reference
    run_dir, cut, at = tmp_path / "run", random.choice(["node2", "node3"]), 4 * random.randint(1, 5)
    head = Head(_args(cluster, _hostfile(tmp_path, THREE + "node4 slots=1 spare\n"),
                      "--max-restarts", "1", *FAST, "--", *_train(run_dir)))
    head.wait_for(_saved(run_dir, at))
    cluster.link_down(cut)
    code, out, err = head.finish()
    assert code == 0, f"cut {cut} at step {at}: {err[-3000:]}"
    row = _row(err, 0)
    assert "host lost" in row and cut in row and f"node4 replaces {cut}" in row, row
    said = out + err
    # Steps go on until the cut stalls the next all-reduce, so a newer checkpoint than the
    # one waited for may be committed first: the resume takes the newest.
    resumed = int(said.split("resumed at step ")[1].split()[0])
    assert at <= resumed < STEPS and f"after restart 1 (cause: host lost: {cut})" in said
    _same(_final_params(run_dir), want_params)
    assert _losses(run_dir) == want_losses  # every step, those after the resumed one too
    cluster.link_up(cut)  # its agent stopped its ranks on its own: the fixture checks


def test_sigterm_to_the_head_mid_step_checkpoints_and_resume_is_bit_exact(cluster, tmp_path,
                                                                          reference):
    want_losses, want_params = reference
    run_dir, at = tmp_path / "run", 4 * random.randint(1, 5)
    args = _args(cluster, _hostfile(tmp_path, THREE), "--grace", "10")
    head = Head([*args, "--", *_train(run_dir)])
    head.wait_for(_saved(run_dir, at))
    head.proc.send_signal(signal.SIGTERM)
    code, _, err = head.finish()
    assert code == 143, err[-3000:]
    stopped = int(err.split("every rank stopped after step ")[1].split(",")[0])
    assert stopped > at and max(step_dirs(run_dir / "checkpoints")) == stopped
    table = report_table(err)
    assert sorted(table) == [0, 1, 2] and all(status.startswith("exit 143 after dtrain's "
                                                                "SIGTERM") for status in
                                              table.values()), table  # none was killed
    res = run_dtrain([*args, "--", *_train(run_dir, resume=True)], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed at step {stopped}" in res.stdout + res.stderr
    _same(_final_params(run_dir), want_params)
    assert _losses(run_dir) == want_losses


def test_min_nodes_goes_on_at_a_smaller_dp_with_the_same_global_batch(cluster, tmp_path):
    run_dir, at = tmp_path / "run", 4 * random.randint(1, 5)
    four = THREE + "node4 slots=1\n"
    head = Head(_args(cluster, _hostfile(tmp_path, four), "--max-restarts", "1",
                      "--min-nodes", "2", *FAST, "--", *_train(run_dir, global_batch=8)))
    head.wait_for(_saved(run_dir, at))
    cluster.link_down("node4")
    code, out, err = head.finish()
    assert code == 0, err[-3000:]
    assert "continuing without node4 (--min-nodes)" in _row(err, 0)
    # 8 does not split over 3 ranks: dp 2 with two microbatches each, rank 2 stands by.
    said = out + err
    assert "world 2 = dp 2 x tp 1 x pp 1" in said and "2 microbatch(es)" in said
    assert "rank 2 stands by" in said
    # The global batch is the same, so the losses are the uninterrupted run's up to rounding
    # (another reduction order after the restart). fp32 as users run it: an fp32 reference
    # and fp32 bounds (tests/support/numerics.py).
    flags = {**MODEL, "global_batch": 8, "steps": STEPS}
    cfg = make_config(flags)
    want = train_serially(cfg, STEPS, fp64=False)
    tokens = 8 * 32 + 32
    atol = bounds(want, steps=STEPS, lr=cfg.optimizer.lr, n_terms=tokens, unit=U32).loss
    got = _losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    torch.testing.assert_close(f64([got[s] for s in sorted(got)]), f64(want["losses"]),
                               rtol=reduction_rtol(tokens, U32), atol=atol)
