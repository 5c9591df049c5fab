"""Recovery time: a failure until every rank trains again, per cause, and against torchrun.

    python -m bench.recovery [--reps 3] [--causes crash,lost,hang] [--json PATH]

Two parts, in one run:

* ``crash (localhost)``: the same program (``bench/workers/recover.py``: torch.distributed,
  gloo, env://) on 2 local ranks under ``torchrun --standalone --max-restarts 1`` and under
  ``dtrain launch --max-restarts 1 --restart-backoff 0``; rank 1 of the first attempt calls
  ``os._exit(1)`` at step 5. From the ranks' own stamps: ``restart`` = the crash until the last
  rank of the second attempt started (the launcher's detection, stop and respawn), ``resume`` =
  from there until the last rank completed a step (the program's own start-up: torch import,
  process group), ``total`` their sum. Target: dtrain's restart <= torchrun's and <= 3 s.
* ``trainer on 3 hosts + 1 spare`` (network-namespace hosts, `testbed.netns`): ``python -m
  trainer.train`` under ``dtrain launch --max-restarts 1``, one failure per run once a
  checkpoint is committed: ``crash`` (SIGKILL of a rank), ``lost`` (its host's link cut; the
  spare takes its place), ``hang`` (SIGSTOP of a rank, ``--hang-timeout 5 --hang-action
  abort``; its host is replaced). The split is dtrain's own report (``goodput.json``):
  detect / stop / restart / resume, and the steps repeated.

Medians over ``reps``; the machine is shared, so the ratios matter more than the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import common

WORKER = common.WORKERS / "recover.py"
CAUSES = ("crash", "lost", "hang")
SUMMARY_COLUMNS = [("part", "part"), ("tool", "tool"), ("cause", "cause"), ("ok", "ok"),
                   ("detect s", "detect_s"), ("stop s", "stop_s"), ("restart s", "restart_s"),
                   ("resume s", "resume_s"), ("total s", "total_s"),
                   ("restart/torchrun", "restart_s_vs_torchrun"), ("repeated", "repeated")]
SUMMARY_NOTE = (
    "crash (localhost): restart = the crash to every rank of the next attempt started (the "
    "launcher's part), resume = from there to every rank's first step (the program's own "
    "start-up). trainer rows: dtrain's goodput.json split; the namespace hosts share this "
    "machine's cores, so the trainer's start-up (resume) is slower than on separate hosts.")


# -- part 1: the same crash under torchrun and dtrain, on localhost ------------------------
def _local_command(tool: str, out: str, logs: str) -> list[str]:
    program = [str(WORKER), out, "40", "1", "5"]
    if tool == "torchrun":
        return [str(common.BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "1", *program]
    return [common.PYTHON, "-m", "launcher", "launch", "--nproc-per-node", "2",
            "--max-restarts", "1", "--restart-backoff", "0", "--grace", "3", "--log-dir", logs,
            "--", common.PYTHON, *program]


def local_crash(tool: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-recovery-") as out:
        done = subprocess.run(_local_command(tool, out, out), capture_output=True, text=True,
                              cwd=common.REPO, env=common.base_env(), timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} exited {done.returncode}: {done.stderr[-1500:]}")
        stamps = [json.loads(p.read_text()) for p in Path(out).glob("a*-r*.json")]
    crash = next(s["crash"] for s in stamps if "crash" in s)
    again = [s for s in stamps if s["attempt"] == 1]
    if len(again) != 2:
        raise RuntimeError(f"{tool}: {len(again)} ranks of the second attempt stamped")
    started = max(s["start"] for s in again)
    trained = max(s["first_step"] for s in again)
    return {"restart_s": started - crash, "resume_s": trained - started,
            "total_s": trained - crash}


# -- part 2: the trainer on namespace hosts, per cause ------------------------------------
TRAIN = ["-m", "trainer.train", "--model", "tiny", "--n-layer", "1", "--d-model", "32",
         "--seq-len", "32", "--global-batch", "6", "--warmup-steps", "1", "--steps", "300",
         "--log-every", "50", "--eval-every", "0", "--save-every", "10", "--data-cap-mb",
         "0.25"]


def trainer_pid(cluster: Any, host: str) -> int | None:
    """The trainer rank running on ``host`` (its process, not the agent's)."""
    for pid in cluster.job_pids(host):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"trainer.train" in cmd and b"launcher" not in cmd:
            return pid
    return None


def inject(cluster: Any, cause: str, host: str) -> None:
    """One failure on ``host``: its rank SIGKILLed or SIGSTOPped, or its link cut."""
    if cause == "lost":
        cluster.link_down(host)
        return
    pid = trainer_pid(cluster, host)
    if pid is not None:
        os.kill(pid, signal.SIGKILL if cause == "crash" else signal.SIGSTOP)


def trainer_failure(cluster: Any, cause: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-recovery-") as tmp:
        hostfile = Path(tmp, "hosts")
        hostfile.write_text("node1 slots=1\nnode2 slots=1\nnode3 slots=1\nnode4 slots=1 spare\n")
        run_dir, logs = Path(tmp, "run"), Path(tmp, "logs")
        head = subprocess.Popen(
            [common.PYTHON, "-m", "launcher", "launch", "-f", str(hostfile), "--ssh-config",
             str(cluster.ssh_config), "--env", "UCX_TLS=tcp", "--max-restarts", "1",
             "--restart-backoff", "0", "--heartbeat-interval", "0.5", "--grace", "3",
             "--hang-timeout", "5", "--hang-action", "abort", "--log-dir", str(logs), "--",
             common.PYTHON, *TRAIN, "--run-dir", str(run_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=common.REPO,
            env=common.base_env())
        try:
            deadline = time.monotonic() + 180
            while not (run_dir / "checkpoints" / "step-20" / "COMMITTED").exists():
                if head.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"training did not start: {head.communicate()[1][-1500:]}")
                time.sleep(0.05)
            inject(cluster, cause, "node2")
            _, err = head.communicate(timeout=300)
        finally:
            head.kill()
            cluster.link_up("node2")
            common.settle(cluster)
        if head.returncode != 0:
            raise RuntimeError(f"exit {head.returncode}: {err[-1500:]}")
        [report] = logs.glob("*/goodput.json")
        [row] = json.loads(report.read_text())["failures"]
    total = sum(row[k] or 0.0 for k in ("detect_s", "stop_s", "restart_s", "resume_s"))
    return {**{k: row[k] for k in ("detect_s", "stop_s", "restart_s", "resume_s")},
            "total_s": total, "repeated": row["steps_repeated"], "blamed": row["blamed"]}


# -- the grid ----------------------------------------------------------------------------
def _median_row(base: dict[str, Any], samples: list[dict[str, Any]], errors: list[str],
                reps: int) -> dict[str, Any]:
    row = {**base, "reps": reps, "ok": len(samples)}
    for key in ("detect_s", "stop_s", "restart_s", "resume_s", "total_s", "repeated"):
        values = [s[key] for s in samples if s.get(key) is not None]
        row[key] = statistics.median(values) if values else None
    if errors:
        row["error"] = errors[0]
    row["samples"] = samples
    return row


def _repeat(measure: Callable[[], dict[str, Any]], reps: int,
            progress: Callable[[str], None] | None, label: str
            ) -> tuple[list[dict[str, Any]], list[str]]:
    samples, errors = [], []
    for rep in range(reps):
        try:
            samples.append(measure())
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
            errors.append(str(exc))
        if progress:
            got = f"total {samples[-1]['total_s']:.2f}s" if len(samples) > rep - len(errors) \
                and samples else errors[-1]
            progress(f"{label} rep {rep + 1}/{reps}: {got}")
    return samples, errors


def run(reps: int = 3, causes: Sequence[str] = CAUSES, local: bool = True,
        progress: Callable[[str], None] | None = None, cluster: Any = None
        ) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if local:
        for tool in ("torchrun", "dtrain"):
            samples, errors = _repeat(lambda tool=tool: local_crash(tool), reps, progress, tool)
            rows.append(_median_row({"part": "crash (localhost)", "tool": tool,
                                     "cause": "crash", "hosts": 1}, samples, errors, reps))
        torchrun = rows[0].get("restart_s")
        rows[1]["restart_s_vs_torchrun"] = rows[1]["restart_s"] / torchrun \
            if torchrun and rows[1].get("restart_s") is not None else None
    if causes:
        with common.bench_cluster(4, cluster) as hosts:
            for cause in causes:
                samples, errors = _repeat(lambda cause=cause: trainer_failure(hosts, cause),
                                          reps, progress, cause)
                rows.append(_median_row({"part": "trainer, 3 hosts + 1 spare",
                                         "tool": "dtrain", "cause": cause, "hosts": 3},
                                        samples, errors, reps))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.recovery", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--causes", default=",".join(CAUSES))
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    rows = run(args.reps, [c for c in args.causes.split(",") if c],
               progress=lambda line: print(line, flush=True))
    return common.report(rows, lambda r: common.print_rows("Recovery time", r, SUMMARY_COLUMNS),
                         args.json)


if __name__ == "__main__":
    sys.exit(main())
