"""Hang diagnosis of unmodified torch.distributed (gloo) programs, through the Flight Recorder
shim (`launcher.agent.flight`): time from a hang to its diagnosis, the recorder's cost per
collective, and how often the culprit is named first.

    python -m bench.flight [--ranks 4,16] [--faults 20] [--kinds skip,mismatch,stop,early]
                           [--timeout 3] [--json PATH]

Hang to diagnosis: `dtrain launch --nproc-per-node N --hang-timeout T --hang-action abort`
(localhost) runs `bench/workers/gloo_fault.py sleep`: at a seeded step one rank writes the wall
time and sleeps while the others wait in a collective; the row gives the time from that moment
to the head printing its diagnosis (target: T + 1 s), and whether the sleeper is named first.

Recorder cost: the same script (`--cost-worker`: 2 gloo ranks, 1 MiB all-reduces) run with the
agent's environment for the recorder and the shim (``TORCH_FR_BUFFER_SIZE``, the shim first on
``PYTHONPATH``, its reader writing every second) and without it, alternately, in ``rounds``
pairs of runs so that drifting load hits both; each run keeps its fastest block of 30
all-reduces (on a shared machine the slow blocks are other processes' time slices); the row
gives the median over runs of each side and the overhead in percent (target: 2 %). The shim's
reads (every second) fall inside some blocks only: ``mean_*`` (all blocks) shows their share.

Culprit first: ``faults`` seeded random faults per kind (the culprit rank and the step differ
per seed) at 4 ranks; the rate at which the diagnosis's headline names the culprit rank first
(target: 100 %). ``--faults 2`` is a quick pass.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "bench" / "workers" / "gloo_fault.py"
KINDS = ("skip", "mismatch", "stop", "early")
NUMEL, PER_RUN, BLOCKS = 1 << 18, 300, 10   # 1 MiB of float32 per all-reduce


def diagnose_run(kind: str, seed: int, ranks: int, timeout: float) -> dict[str, Any]:
    """One launch of the fault worker; the culprit, the headline's first rank, the latency."""
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-flight-") as tmp:
        stamp, logs = Path(tmp, "stamp"), Path(tmp, "logs")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "launcher", "launch", "--nproc-per-node", str(ranks),
             "--hang-timeout", str(timeout), "--hang-action", "abort", "--grace", "1",
             "--log-dir", str(logs), "--", sys.executable, str(WORKER), kind, str(seed),
             str(stamp)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env)
        seen, headline = None, ""
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith("dtrain: hang:") and seen is None:
                seen, headline = time.time(), line
        out = proc.stdout.read() if proc.stdout else ""
        proc.wait(timeout=120)
        culprit = re.search(r"culprit (\d+)", out)
        named = re.search(r"cause: rank (\d+) ", headline)
        latency = seen - float(stamp.read_text()) if seen and stamp.exists() else None
        return {"kind": kind, "seed": seed, "ranks": ranks, "hang_timeout_s": timeout,
                "culprit": int(culprit[1]) if culprit else None,
                "named_first": int(named[1]) if named else None,
                "diagnosis_after_s": latency, "exit_code": proc.returncode,
                "headline": headline.strip()[:300]}


def cost_worker(out: Path) -> None:
    """One rank (under ``torch.distributed``'s env rendezvous): timed 1 MiB all-reduces."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(NUMEL)
    for _ in range(20):  # warm-up: connections, allocations
        dist.all_reduce(t)
    blocks = []
    for _ in range(BLOCKS):  # the least disturbed block: other processes' time slices and
        dist.barrier()       # the shim's reads land in some blocks, not in all
        start = time.perf_counter()
        for _ in range(PER_RUN // BLOCKS):
            dist.all_reduce(t)
        blocks.append((time.perf_counter() - start) / (PER_RUN // BLOCKS))
    if dist.get_rank() == 0:
        out.write_text(json.dumps([min(blocks), statistics.mean(blocks)]))
    dist.barrier()
    dist.destroy_process_group()


def cost_run(recorded: bool) -> tuple[float, float]:
    """(fastest block, mean of blocks): seconds per all-reduce of one run (on a free port: a
    fixed one is taken by whatever else runs here, a second bench or test run among them)."""
    from launcher.agent import flight
    from testbed.sshd import free_port

    with tempfile.TemporaryDirectory(prefix="dtrain-bench-fr-") as tmp:
        out, port = Path(tmp, "took"), free_port()
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(2):
                env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2"}
                for name in (*flight.BUFFER_NAMES, flight.FILE):
                    env.pop(name, None)
                if recorded:
                    env.update(flight.rank_env(env, str(Path(tmp, f"rank-{rank}.progress")),
                                               1.0))
                procs.append(subprocess.Popen([sys.executable, "-m", "bench.flight",
                                               "--cost-worker", str(out)], cwd=REPO, env=env))
            for p in procs:
                p.wait(timeout=600)
        finally:  # a rank that failed leaves its peer waiting: nothing stays behind
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs) or not out.exists():
            raise RuntimeError(f"cost run failed (recorded={recorded})")
        fastest, mean = json.loads(out.read_text())
        return float(fastest), float(mean)


def recorder_cost(rounds: int) -> dict[str, Any]:
    sides: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for r in range(rounds):
        for recorded in ((True, False) if r % 2 == 0 else (False, True)):
            sides[recorded].append(cost_run(recorded))
    bare = statistics.median(f for f, _ in sides[False])
    rec = statistics.median(f for f, _ in sides[True])
    mean_bare = statistics.median(m for _, m in sides[False])
    mean_rec = statistics.median(m for _, m in sides[True])
    return {"measure": "recorder cost per 1 MiB all_reduce (2 gloo ranks)", "rounds": rounds,
            "bare_ms": bare * 1e3, "recorded_ms": rec * 1e3,
            "overhead_pct": (rec - bare) / bare * 100, "mean_bare_ms": mean_bare * 1e3,
            "mean_recorded_ms": mean_rec * 1e3,
            "mean_overhead_pct": (mean_rec - mean_bare) / mean_bare * 100}


def run(ranks: Sequence[int] = (4, 16), faults: int = 20, kinds: Sequence[str] = KINDS,
        timeout: float = 3.0, rounds: int = 5,
        progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    sys.path.insert(0, str(REPO))
    say = progress or (lambda line: None)
    rows: list[dict[str, Any]] = []
    for n in ranks:
        one = diagnose_run("sleep", 1, n, timeout)
        rows.append({"measure": "hang to diagnosis", **one,
                     "beyond_timeout_s": one["diagnosis_after_s"] - timeout
                     if one["diagnosis_after_s"] is not None else None})
        say(json.dumps(rows[-1]))
    if rounds:  # 0: no cost runs (a culprit-only pass)
        rows.append(recorder_cost(rounds))
        say(json.dumps(rows[-1]))
    for kind in kinds:
        runs = [diagnose_run(kind, seed, 4, timeout) for seed in range(faults)]
        hits = [r["culprit"] is not None and r["named_first"] == r["culprit"] for r in runs]
        misses = [{k: r[k] for k in ("seed", "culprit", "named_first", "exit_code", "headline")}
                  for r, hit in zip(runs, hits, strict=True) if not hit]
        first = sum(hits)
        lat = [r["diagnosis_after_s"] for r in runs if r["diagnosis_after_s"] is not None]
        rows.append({"measure": "culprit first", "kind": kind, "faults": faults,
                     "named_first": first, "rate_pct": 100 * first / max(1, faults),
                     "median_diagnosis_after_s": statistics.median(lat) if lat else None,
                     "misses": misses})
        say(json.dumps(rows[-1]))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.flight", description=__doc__)
    ap.add_argument("--ranks", default="4,16")
    ap.add_argument("--faults", type=int, default=20)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--cost-worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cost_worker:
        cost_worker(args.cost_worker)
        return 0
    rows = run([int(n) for n in args.ranks.split(",") if n], args.faults,
               [k for k in args.kinds.split(",") if k], args.timeout, args.rounds,
               progress=print)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
