"""Hang diagnosis, stragglers and the live view of real jobs (`dtrain launch --hang-timeout`,
`--hang-action`, `--status-interval`), on network-namespace hosts with real MPICH ranks.

After every scenario no process of the job may remain on any host (`ip netns pids`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.support import (
    PYTHON,
    REPO,
    alive,
    kill_recorded,
    run_dtrain,
    run_with_link_cut,
    start_dtrain,
    wait_for_lines,
)
from trainer.comm.mesh import splits
from trainer.comm.topology import MeshShape

WORKER = str(REPO / "tests" / "support" / "workers" / "hang_worker.py")
HANG_TIMEOUT = 3.0
# Diagnosis within the timeout plus: one sampling interval, the probe with py-spy stacks, and
# start-up of the ranks (torch and MPI imports on a loaded 2-core machine).
SLACK_S = 60.0


def _hang_args(cluster, hosts: str, log_dir: Path) -> list[str]:
    return ["launch", "-H", hosts, "--ssh-config", str(cluster.ssh_config),
            "--hang-timeout", str(HANG_TIMEOUT), "--hang-action", "abort", "--grace", "1",
            "--log-dir", str(log_dir)]


def _diagnosis(log_dir: Path) -> str:
    (path,) = log_dir.glob("*/hang-1.txt")
    return path.read_text()


def test_a_rank_that_skips_an_all_reduce_is_named_and_the_job_is_aborted(cluster, tmp_path):
    started = time.monotonic()
    res = run_dtrain([*_hang_args(cluster, "node1:2,node2:2", tmp_path), "--", PYTHON,
                      WORKER, "skip"], timeout=120)
    assert res.returncode == 123, res.stderr[-3000:]
    text = _diagnosis(tmp_path)
    # dp 2 x tp 2: rank 2's DP group is dp[0] = {0, 2}; it skipped its 3rd all-reduce, so
    # rank 0's 5th (#5 on dp[0]) is the one rank 2 never entered. Rank 2 waits in the final
    # barrier for rank 0 in turn: a cycle, broken by the ranks in the barrier with rank 2,
    # which entered 5 operations on their DP group where rank 2 entered 4. Its barrier comes
    # after the splits of `Mesh.build` on the world.
    assert text.splitlines()[0].endswith(
        "cause: rank 2 (node2) never entered all_reduce #5 on dp[0] (float32, 1.0 KiB), which "
        "rank 0 (node1) waits in: it entered 4 operations on dp[0], in conflict with the counts "
        "of 3 other ranks (the same program cannot have brought them there); now it waits in "
        f"barrier #{len(splits(MeshShape(dp=2, tp=2))) + 1} on world"), text
    assert "rank 0 (node1) waits in all_reduce #5 on dp[0]" in text and "a consequence" in text
    assert "first failure: rank 2@node2: hung (rank 2 (node2) never entered" in res.stderr
    assert time.monotonic() - started < HANG_TIMEOUT + SLACK_S


def test_a_stage_blocked_in_a_pipeline_receive_names_its_peer_with_its_stack(cluster,
                                                                             tmp_path):
    res = run_dtrain([*_hang_args(cluster, "node1:1,node2:1", tmp_path), "--", PYTHON,
                      WORKER, "pipe"], timeout=120)
    assert res.returncode == 123, res.stderr[-3000:]
    text = _diagnosis(tmp_path)
    assert ("cause: rank 1 (node2) never posted its part of batch_p2p #6 on pp[0] (float32, "
            "256 B), which rank 0 (node1) waits in; it is in no communication operation at "
            "step 2") in text, text
    assert "stack of rank 1" in text and "pipe (hang_worker.py" in text  # py-spy's dump


def test_a_stopped_rank_of_a_pipeline_training_run_is_named_as_stopped(cluster, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_dtrain([*_hang_args(cluster, "node1:1,node2:1", tmp_path), "--", PYTHON,
                         "-m", "trainer.train", "--model", "tiny", "--pp", "2",
                         "--microbatches", "2", "--steps", "400", "--data-cap-mb", "1",
                         "--run-dir", str(run_dir)])
    stopped: list[int] = []
    try:
        wait_for_lines(run_dir / "metrics.jsonl", 3, timeout=120)
        stopped = [p for p in cluster.job_pids("node2") if _is_rank(p)]
        assert len(stopped) == 1
        os.kill(stopped[0], signal.SIGSTOP)
        _, err = proc.communicate(timeout=120)
    finally:
        kill_recorded([proc.pid])
    assert proc.returncode == 123, err[-3000:]
    text = _diagnosis(tmp_path)
    assert f"rank 1 (node2): is stopped (SIGSTOP/SIGTSTP); `kill -CONT {stopped[0]}`" in text
    # Where rank 0 waits depends on where the stop landed (a pipeline p2p on pp[0], the tied
    # embedding's all-reduce on embd[0], the loss or time-limit reductions on the world): any
    # operation of a group it shares with the stopped rank; it is named as waiting for it.
    # A stop that lands after rank 1 entered the operation leaves rank 0 inside one that every
    # member entered: it still waits for the stopped rank, which cannot finish it.
    op = r"\w+ #\d+ on \w+(\[\d+\])?"
    assert re.search(rf"cause: rank 1 \(node2\) is stopped [^\n]*; rank 0 \(node1\) waits for "
                     rf"it in {op}", text), text
    assert "every member entered it" not in text, text


def test_a_rank_stalled_inside_a_send_is_named_first_and_its_receiver_after_it(cluster,
                                                                               tmp_path):
    """Rank 2 (node2) posts a 4 MiB send to rank 0 (node1) after the test made node2's packets
    to node1 vanish (node1's address resolves to a hardware address nobody has): both halves
    are posted, nothing arrives, ranks 1 and 3 wait in the next all-reduce. The sender is
    named first, its receiver after it; the other waiters are consequences."""
    ready, go, logs = tmp_path / "ready", tmp_path / "go", tmp_path / "logs"
    ns, node1 = cluster.namespace("node2"), cluster.address("node1")
    # UCX_TLS=tcp: the namespace hosts share one kernel, and UCX would otherwise carry the
    # ranks' traffic through shared memory, past the network (`tests.cluster.test_restart_cluster`).
    code, err = run_with_link_cut(
        [*_hang_args(cluster, "node1:2,node2:2", logs), "--env", "UCX_TLS=tcp",
         "--", PYTHON, WORKER, "sendstall", str(ready), str(go)],
        ns=ns, peer=node1, ready=ready, go=go, timeout=120)
    assert code == 123, err[-3000:]
    text = _diagnosis(logs)
    # World operations: a send or receive and an all-reduce per step for ranks 0 and 2, so the
    # third step's send is #5; ranks 1 and 3 wait in their third all-reduce.
    assert text.splitlines()[0].endswith(
        "cause: rank 2 (node2) is stalled inside send #5 on world (float32, 4.0 MiB) to rank 0 "
        "(node1), which waits in recv #5 on world for it: the posted send never arrives (its "
        "host's network, or the transport under it, does not deliver); ranks 1 (node1), 3 "
        "(node2) wait for it too"), text
    assert "stack of rank 2" in text and "sendstall (hang_worker.py" in text
    assert "first failure: rank 2@node2: hung (rank 2 (node2) is stalled inside send" in err
    assert not cluster.wait_no_job_pids(timeout=30)


# One real run per operation kind, on both the TP group and the world, with the skipping rank
# as a broadcast's root and not: (kind, family, rank, elements). The non-root broadcast is 1 MiB:
# a small one's root returns at once and nobody hangs (`tests.launcher.test_hang_blame`).
REAL_SKIPS = [("all_reduce", "tp", 1, 256), ("all_gather", "world", 2, 256),
              ("reduce_scatter", "tp", 3, 256), ("broadcast", "tp", 0, 256),
              ("broadcast", "world", 1, 262144), ("p2p", "world", 1, 256)]


@pytest.mark.parametrize(("kind", "family", "rank", "numel"), REAL_SKIPS,
                         ids=[f"{k}-{f}-rank{r}" for k, f, r, _ in REAL_SKIPS])
def test_real_ranks_blame_exactly_the_rank_that_skipped_an_operation(kind, family, rank, numel,
                                                                    tmp_path):
    """4 MPICH ranks (dp 2 x tp 2) run every operation kind on the TP group and the world each
    step; one leaves one out in the last step. The headline names it, the operation, group
    and sequence number it skipped, and the job's failure blames only it."""
    from tests.launcher.test_hang_blame import skipped

    res = run_dtrain(["launch", "--nproc-per-node", "4", "--hang-timeout", str(HANG_TIMEOUT),
                      "--hang-action", "abort", "--grace", "1", "--log-dir", str(tmp_path),
                      "--", PYTHON, WORKER, "leave", kind, family, str(rank), str(numel)],
                     timeout=120)
    assert res.returncode == 123, res.stderr[-3000:]
    first = _diagnosis(tmp_path).splitlines()[0]
    label = f"tp[{rank // 2}]" if family == "tp" else "world"
    op = "batch_p2p" if kind == "p2p" else kind
    assert f"cause: rank {rank} (localhost) " in first, first
    assert f"{op} #{skipped(kind, family)[1]} on {label}" in first, first
    assert f"first failure: rank {rank}@localhost: hung (" in res.stderr, res.stderr[-3000:]


def _is_rank(pid: int) -> bool:
    try:
        return b"trainer.train" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_a_rank_computing_alone_longer_than_the_timeout_while_the_other_waits_is_no_hang(
        tmp_path):
    """Rank 1 computes for 8 s outside communication while rank 0 waits for it in an
    all-reduce, under a 2 s timeout: the agent sees rank 1 use its core, so nothing is
    reported and the job ends normally."""
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--hang-timeout", "2", "--hang-action",
                      "abort", "--log-dir", str(tmp_path), "--", PYTHON, WORKER, "busy"],
                     timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "rank 1 done" in res.stdout and "hang" not in res.stderr, res.stderr[-3000:]
    assert not list(tmp_path.rglob("hang-*.txt"))


# The healthy job trains for this long (measured from its first logged step to its exit).
HEALTHY_TRAIN_S = 150.0


def test_a_several_minute_healthy_training_run_reports_no_hang_and_only_its_straggler(tmp_path):
    """Three ranks train the tiny model for 150 s under a 3 s hang timeout (--time-limit, so
    the run lasts as long on any machine), doing everything a healthy job does that stands
    still for a moment: start-up and data loading, a slow first step, evaluation and
    checkpoint saves (rank 0 writes while the others wait in the next step's all-reduce; old
    checkpoints are pruned), and a straggler: rank 1 CPU-throttled by the test (stopped 80% of
    the time in 20 ms cycles, shorter than a step, so that every step's compute takes about 5
    times as long: with 0.25 s cycles only the steps a stop happened to land in were slow, and
    once the steps got fast, their average was not always past the straggler limit), which the
    others wait for at every step. Nothing is reported
    as a hang, in the output or the log dir; rank 1 is named as the straggler, in the live
    view and at the end, and no other rank is; nothing of the job is left running."""
    run_dir, log_dir = tmp_path / "run", tmp_path / "logs"
    proc = start_dtrain(["launch", "--nproc-per-node", "3", "--hang-timeout", "3",
                         "--hang-action", "abort", "--status-interval", "5", "--log-dir",
                         str(log_dir), "--", PYTHON, "-m", "trainer.train", "--model", "tiny",
                         "--steps", "1000000", "--time-limit", str(HEALTHY_TRAIN_S + 5),
                         "--global-batch", "12", "--log-every", "5", "--eval-every", "40",
                         "--save-every", "40", "--keep", "2", "--data-cap-mb", "1",
                         "--run-dir", str(run_dir)])
    done = threading.Event()
    seen: dict[str, object] = {}
    throttle = threading.Thread(target=_throttle, args=(proc.pid, run_dir, done, seen))
    throttle.start()
    try:
        _, err = proc.communicate(timeout=HEALTHY_TRAIN_S + 300)
        ended = time.monotonic()
    finally:
        done.set()
        throttle.join()
        kill_recorded([proc.pid])
    assert proc.returncode == 0, err[-3000:]
    assert ended - seen["first_step"] >= HEALTHY_TRAIN_S, "the healthy run was too short"
    assert not [line for line in err.splitlines() if "hang" in line.lower()], err[-3000:]
    assert not list(log_dir.rglob("hang-*.txt"))
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = steps[-1]["step"]
    assert last < 1000000 and sum(s["val_loss"] is not None for s in steps) >= 3
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == sorted(
        f"step-{s}" for s in ((last - 1) // 40 * 40, last))  # a mid-run save, kept, and the last
    finals = [line for line in err.splitlines() if line.startswith("dtrain: straggler:")]
    assert len(finals) == 1 and finals[0].startswith("dtrain: straggler: rank 1 (localhost)"), \
        err[-3000:]
    table = [line.split() for line in err.splitlines() if "STRAGGLER" in line]
    assert table and all(row[1:3] == ["localhost", "1"] for row in table)
    assert seen["ranks"] and not [p for p in seen["ranks"] if alive(p)]


def _throttle(head: int, run_dir: Path, done: threading.Event, seen: dict[str, object]) -> None:
    """Stop and continue rank 1 (found among the head's descendants) until ``done``; notes
    when the first step was logged and the ranks' PIDs in ``seen``."""
    wait_for_lines(run_dir / "metrics.jsonl", 1, timeout=120)
    seen["first_step"] = time.monotonic()
    ranks = [p for p in psutil.Process(head).children(recursive=True)
             if "trainer.train" in " ".join(p.cmdline())]
    seen["ranks"] = [p.pid for p in ranks]
    (rank1,) = [p for p in ranks if p.environ().get("RANK") == "1"]
    try:
        while not done.is_set() and rank1.is_running():
            rank1.send_signal(signal.SIGSTOP)
            time.sleep(0.016)
            rank1.send_signal(signal.SIGCONT)
            time.sleep(0.004)
    except psutil.NoSuchProcess:
        pass
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            rank1.send_signal(signal.SIGCONT)


def test_check_perf_times_every_host_and_the_link_between_them(cluster):
    res = run_dtrain(["check", "-H", "node1:1,node2:1", "--ssh-config", str(cluster.ssh_config),
                      "--perf"], timeout=300)
    rows = {line.split("│")[1].strip(): line for line in res.stdout.splitlines()
            if line.count("│") >= 4}
    results = []
    for name in ("node1", "node2", "node1 - node2"):
        assert name in rows, res.stdout + res.stderr
        cells = [c.strip() for c in rows[name].split("│")]
        assert float(cells[2]) > 0 and cells[3] in ("ok", "SLOW")
        results.append(cells[3])
    # Speeds on this shared machine are not asserted; the verdict must match the table.
    flagged = [line for line in res.stderr.splitlines() if line.startswith("dtrain check --perf")]
    assert res.returncode == (1 if "SLOW" in results else 0), res.stderr
    assert len(flagged) == results.count("SLOW")
