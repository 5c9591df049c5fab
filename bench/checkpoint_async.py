"""Checkpoints that do not stop training: saves in the background vs in place, against the disk.

    python -m bench.checkpoint_async [--configs A,B] [--steps 30] [--every 10] [--reps 3]
                                     [--dir FOLDER] [--json PATH]

For each configuration (the ``125m`` preset, ~85M parameters, at dp 2; the ``small`` preset at
dp 2 x tp 2 x pp 2), in one run and on one disk (``--dir``, default the temporary folder: the
run dirs and dd's file):

* ``dd`` writes as many bytes as the in-place run's checkpoint (``bs=1M``, ``conv=fsync``) right
  after each in-place run: the disk's own sequential write speed for that amount at that
  moment (the disk is shared with whatever else runs). A fixed 1 GiB, as before, measured
  the small configuration's 39 MB save against a write 26 times its size.
* ``python -m trainer.train`` runs ``steps`` steps three ways through ``dtrain launch`` (``reps``
  times each, the order rotated; ratios are taken within a repetition, medians reported): no save
  but the last (``--save-every 0``), a save every ``every`` steps in place
  (``--no-async-save``), and in the background (``--async-save``). From ``metrics.jsonl``: the
  seconds the loop was blocked per save (the median of the saves before the last; in the
  background: at the save's step, reading its late agreement at the next step's end, and any
  wait for its copy before the optimizer's step), the seconds later step ends spent moving a
  background save on (its votes, and the collectives that settle and finish it), the save's
  MB/s (the in-place saves, whose write has the machine to itself, and the last background
  save, which the end of training waits for): MB of every rank over the seconds the save was
  writing (`trainer.checkpoint.rate.busy`: every moment some rank wrote its file, and all
  from the last write to the end of the commit, the agreement and the commit's fsyncs
  included), the time dd's MB/s is over too. Until 2026-11-29 the seconds ran from the first
  rank's staging to the commit (still reported: ``span``); but the ranks reach a save 10-30 ms
  apart (the pipeline's stages end a step at different times, 8 ranks on 2 cores), and while
  the late ones still compute their step and the early ones have written, nobody writes:
  that wait is the training's, not the disk's, and dd has none,
  and the loop's time per step (steps 2..N plus the blocked seconds of the saves before the
  last) against the run without saves; within each run, the median of the 3 steps after each
  save (a background save copies, writes and commits during them) against the median of the
  steps from the 5th after a save on: what a step pays while a save is in flight, free of the
  load's drift from launch to launch (the run without saves gives the same ratio for steps
  that follow no save: the noise floor).
* The load: a rank-0 clock around building the run, with ``--resume`` from the last checkpoint
  minus without it (`bench/workers/checkpoint_load.py`), for the checkpoints both modes wrote
  (twice each, alternated, the faster kept: the page cache warm for both).

Targets (issue 40): blocked >= 10x less in the background than in place; save MB/s >= 0.8x
dd's; step time with a save every 10 steps <= 1.05x the run without. The tensor files are
written with direct I/O (`trainer.checkpoint.direct`), dd through the page cache as above.
The ranks of this bench share the machine's cores with the background writer (one thread per
rank): on a machine with a core to spare per rank, the background write does not slow the
steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import common

CONFIGS = {
    "125m dp2": (2, ["--model", "125m", "--seq-len", "64", "--global-batch", "2"]),
    "small dp2xtp2xpp2": (8, ["--model", "small", "--seq-len", "64", "--global-batch", "4",
                              "--tp", "2", "--pp", "2", "--microbatches", "2"]),
}
COMMON = ["--warmup-steps", "1", "--data-cap-mb", "1", "--eval-every", "0", "--keep", "1"]
MODES = {"none": ["--save-every", "0"], "sync": ["--no-async-save"], "async": ["--async-save"]}
SUMMARY_COLUMNS = [("config", "config"), ("load avg", "loadavg"), ("ckpt MB", "mb"),
                   ("dd MB/s", "dd_mb_s"), ("sync MB/s", "sync_mb_s"),
                   ("sync/dd", "sync_vs_dd"), ("sync span MB/s", "sync_span_mb_s"),
                   ("span/dd", "span_vs_dd"), ("async last MB/s", "async_mb_s"),
                   ("blocked sync s", "blocked_sync_s"), ("blocked async s", "blocked_async_s"),
                   ("blocked ratio", "blocked_ratio"), ("async step-end s", "step_end_async_s"),
                   ("step none s", "step_none_s"),
                   ("step sync/none", "step_sync_ratio"), ("step async/none", "step_async_ratio"),
                   ("async steps after/quiet", "async_after_ratio"),
                   ("none steps after/quiet", "none_after_ratio"),
                   ("load sync-saved s", "load_sync_s"), ("load async-saved s", "load_async_s")]
SUMMARY_NOTE = ("dd: conv=fsync, as many bytes as one checkpoint. Blocked: median seconds the "
                "training loop waited per save (not the last). Step-end: median seconds "
                "later step ends spent moving a background save on. MB/s: all ranks' MB / seconds "
                "some rank was writing, then to the commit's end; span: from the first rank's "
                "staging to the commit. Step ratios: loop seconds per step (steps 2..N, "
                "blocked seconds included) against the run without saves. Steps after/quiet: "
                "median step of the 3 after each save / of those from the 5th on, in one run "
                "(none: the same steps without saves). Shared machine: "
                "the load average is the one at the configuration's start.")


def dd_mb_s(folder: Path, mb: float) -> float:
    """MB/s (10^6 bytes) of one sequential write of ``mb`` MB, fsynced, as dd does it."""
    out, count = folder / "dd.bin", max(1, round(mb / 1.048576))
    began = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={out}", "bs=1M", f"count={count}", "conv=fsync",
                    "status=none"], check=True)
    seconds = time.perf_counter() - began
    out.unlink()
    return count * 1.048576 / seconds


def train(ranks: int, run_dir: Path, args: list[str]) -> list[dict[str, Any]]:
    """One ``dtrain launch`` of the trainer; its metrics records."""
    cmd = [str(common.BIN / "dtrain"), "launch", "--nproc-per-node", str(ranks), "--",
           common.PYTHON, "-m", "trainer.train", *args, "--run-dir", str(run_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def load_seconds(ranks: int, run_dir: Path, args: list[str]) -> float:
    """Rank 0's seconds to load the newest checkpoint of ``run_dir`` (build with --resume
    minus without)."""
    cmd = [str(common.BIN / "dtrain"), "launch", "--nproc-per-node", str(ranks), "--",
           common.PYTHON, str(common.REPO / "bench" / "workers" / "checkpoint_load.py"), *args,
           "--run-dir", str(run_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    lines = [ln for ln in done.stdout.splitlines() if "load_s" in ln]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    return float(json.loads(lines[-1].split("] ", 1)[-1])["load_s"])


def measure(records: list[dict[str, Any]], last: int, every: int) -> dict[str, Any]:
    """Blocked seconds per save, MB/s of the saves, loop seconds per step, and the median
    step of the 3 after each save (the background save's copy, write and commit run during
    them) against the median of the steps from the 5th after a save to the next save, in the
    same run (launch to launch, the machine's load moves more than a save costs)."""
    saves = [s for r in records for s in r.get("checkpoint") or []]
    before = [s for s in saves if s["step"] != last]
    steps = [r["step_s"] for r in records if r["step"] >= 2]
    loop = sum(steps) + sum(s["blocked_s"] for s in before)
    after = [r["step_s"] for r in records if r["step"] > every and 1 <= r["step"] % every <= 3]
    quiet = [r["step_s"] for r in records if r["step"] > every and r["step"] % every >= 5]
    return {"blocked_s": statistics.median(s["blocked_s"] for s in before) if before else 0.0,
            "span_mb_s_all": [s.get("span_mb_s", 0.0) for s in saves],
            "step_end_s": statistics.median(s.get("step_end_s", 0.0) for s in before)
            if before else 0.0,
            "mb": saves[-1]["mb"], "mb_s_all": [s["mb_s"] for s in saves],
            "last_mb_s": saves[-1]["mb_s"], "step_s": loop / len(steps),
            "after_vs_quiet": statistics.median(after) / statistics.median(quiet)
            if after and quiet else 0.0}


def run(configs: Sequence[str] = tuple(CONFIGS), steps: int = 30, every: int = 10,
        reps: int = 3, where: str | None = None, progress: Any = print) -> list[common.Row]:
    """Rows per configuration; the run dirs and dd's file under ``where`` (None: the system's
    temporary folder): the disk measured. Each ratio is taken within one repetition (dd right
    after the in-place run, as many bytes as its checkpoint), the row holds the medians over
    the repetitions."""
    rows = []
    for name in configs:
        ranks, model = CONFIGS[name]
        with tempfile.TemporaryDirectory(prefix="ckpt-bench-", dir=where) as tmp:
            folder = Path(tmp)
            row: common.Row = {"config": name, "loadavg": round(os.getloadavg()[0], 1)}
            reps_seen = []
            for rep in range(reps):  # the modes rotated, so drifting load hits each alike
                order = list(MODES)[rep % len(MODES):] + list(MODES)[:rep % len(MODES)]
                seen: dict[str, dict[str, Any]] = {}
                for mode in order:
                    flags = MODES[mode]
                    args = [*model, *COMMON, "--steps", str(steps), "--log-every", str(every),
                            *(flags if mode == "none" else ["--save-every", str(every), *flags])]
                    shutil.rmtree(folder / mode, ignore_errors=True)
                    seen[mode] = measure(train(ranks, folder / mode, args), steps, every)
                    if mode == "sync":  # the same bytes, right after
                        seen["dd"] = {"mb_s": dd_mb_s(folder, seen[mode]["mb"])}
                    progress(f"{name} rep {rep} {mode}: {seen[mode]}")
                reps_seen.append(seen)
            row |= summary(reps_seen)
            loads: dict[str, list[float]] = {"sync": [], "async": []}
            for mode in ("sync", "async") * 2:  # alternated; the faster of two (warm cache)
                loads[mode].append(load_seconds(ranks, folder / mode,
                                                [*model, *COMMON, "--steps", str(steps)]))
            row |= {f"load_{mode}_s": round(min(seen), 3) for mode, seen in loads.items()}
            progress(f"{name}: {row}")
            rows.append(row)
    return rows


def summary(reps: list[dict[str, dict[str, Any]]]) -> common.Row:
    """Medians over the repetitions of each number and of each within-repetition ratio."""
    def med(values: list[float], digits: int = 3) -> float:
        return round(statistics.median(values), digits)

    sync_mb_s = [statistics.median(r["sync"]["mb_s_all"]) for r in reps]
    span_mb_s = [statistics.median(r["sync"]["span_mb_s_all"]) for r in reps]
    return {
        "mb": reps[0]["sync"]["mb"], "dd_mb_s": med([r["dd"]["mb_s"] for r in reps], 1),
        "sync_mb_s": med(sync_mb_s, 1),
        "sync_vs_dd": med([m / r["dd"]["mb_s"] for m, r in zip(sync_mb_s, reps, strict=True)]),
        "sync_span_mb_s": med(span_mb_s, 1),
        "span_vs_dd": med([m / r["dd"]["mb_s"] for m, r in zip(span_mb_s, reps, strict=True)]),
        "async_mb_s": med([r["async"]["last_mb_s"] for r in reps], 1),
        "blocked_sync_s": med([r["sync"]["blocked_s"] for r in reps]),
        "blocked_async_s": med([r["async"]["blocked_s"] for r in reps]),
        "blocked_ratio": med([r["sync"]["blocked_s"] / max(r["async"]["blocked_s"], 1e-6)
                              for r in reps], 1),
        "step_end_async_s": med([r["async"]["step_end_s"] for r in reps], 4),
        "step_none_s": med([r["none"]["step_s"] for r in reps], 4),
        "step_sync_ratio": med([r["sync"]["step_s"] / r["none"]["step_s"] for r in reps]),
        "step_async_ratio": med([r["async"]["step_s"] / r["none"]["step_s"] for r in reps]),
        "async_after_ratio": med([r["async"]["after_vs_quiet"] for r in reps]),
        "none_after_ratio": med([r["none"]["after_vs_quiet"] for r in reps]),
        "raw": reps}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.checkpoint_async", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3, help="runs of each mode, rotated")
    ap.add_argument("--dir", help="folder on the disk to measure (default: the temp folder)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    rows = run(args.configs.split(","), args.steps, args.every, args.reps, args.dir,
               progress=lambda line: print(line, flush=True))
    return common.report(rows, lambda r: common.print_rows("Asynchronous checkpoints", r,
                                                           SUMMARY_COLUMNS), args.json)


if __name__ == "__main__":
    sys.exit(main())
