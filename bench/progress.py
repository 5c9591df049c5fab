"""Progress records: per-operation overhead, and time from a hang to its diagnosis.

    python -m bench.progress [--ranks 2] [--timeouts 2,5] [--json PATH]

Overhead: N ranks started by the MPICH wheel's ``mpiexec`` run small fp32 all-reduces (8 and
1024 elements) on the same MPI communicator, alternately bare (`MpiCommunicator`) and wrapped
by `RecordingCommunicator` writing its memory-mapped record, in interleaved rounds of the same
run so drift and load hit both sides alike; the row gives the median time per operation of
each and their difference, and the same of each side's fastest round (the one least disturbed
by other processes on a shared machine). ``record_ns`` (the record's writes alone: enter and
completion) and ``wrapper_ns`` (the whole recording layer around a do-nothing all-reduce) are
timed in one process without MPI (`record_cost_ns`), where a few hundred ns are not lost in
MPI's noise.

Hang to diagnosis: `dtrain launch --nproc-per-node 2 --hang-timeout T --hang-action abort`
runs ranks where rank 1 stops calling collectives (it notes the wall time first) while rank 0
waits in an all-reduce; the row gives the time from that moment to the head printing its
diagnosis, and what it took beyond T (sampling, the probe with py-spy stacks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SIZES = (8, 1024)
ROUNDS, PER_ROUND = 40, 200


def overhead_worker(out: Path) -> None:
    """One rank: interleaved rounds of bare and recorded all-reduces; rank 0 writes the rows."""
    import torch

    from trainer.comm.bootstrap import init
    from trainer.comm.progress import ProgressRecord, RecordingCommunicator

    world = init(backend="mpi")
    bare = world.comm
    recorded = RecordingCommunicator(bare, ProgressRecord(str(out.with_name(
        f"rank-{world.rank}.progress")), world.rank), "world")
    rows = []
    for n in SIZES:
        t = torch.ones(n)
        times: dict[str, list[float]] = {"bare": [], "recorded": []}
        for r in range(ROUNDS):
            order = [("bare", bare), ("recorded", recorded)]
            for name, comm in order if r % 2 == 0 else order[::-1]:
                bare.barrier()
                start = time.perf_counter()
                for _ in range(PER_ROUND):
                    comm.all_reduce(t)
                times[name].append((time.perf_counter() - start) / PER_ROUND)
        b, w = statistics.median(times["bare"]), statistics.median(times["recorded"])
        fb, fw = min(times["bare"]), min(times["recorded"])
        rows.append({"elements": n, "bare_us": b * 1e6, "recorded_us": w * 1e6,
                     "overhead_us": (w - b) * 1e6, "fastest_bare_us": fb * 1e6,
                     "fastest_recorded_us": fw * 1e6, "fastest_overhead_us": (fw - fb) * 1e6})
    if world.rank == 0:
        out.write_text(json.dumps(rows))
    bare.barrier()


def record_cost_ns(path: Path, n: int = 5000, rounds: int = 40) -> dict[str, float]:
    """Per operation, in one process without MPI (the fastest of ``rounds`` tight loops of
    ``n``, so another process's time slice is not counted): ``record_ns``, the record's writes
    alone (enter and completion, as every blocking operation pays them); ``wrapper_ns``, the
    whole recording layer: `RecordingCommunicator.all_reduce` over a communicator whose
    all-reduce does nothing, less that communicator called bare."""
    import torch

    from trainer.comm.progress import ProgressRecord, RecordingCommunicator

    class Loopback:
        rank, size, name, backend = 0, 1, "world", "loopback"

        def all_reduce(self, t: torch.Tensor, op: object = None, *,
                       async_op: bool = False) -> None:
            return None

    record = ProgressRecord(str(path), 0)
    slot = record.slot("bench", 0, 1)
    bare = Loopback()
    wrapped = RecordingCommunicator(bare, record, "world")
    t = torch.ones(8)

    def writes() -> None:
        slot.enter(1, t)
        slot.after(None)

    loops = {"record": writes, "bare": lambda: bare.all_reduce(t),
             "wrapped": lambda: wrapped.all_reduce(t)}
    best = {name: float("inf") for name in loops}
    for _ in range(rounds):
        for name, fn in loops.items():
            best[name] = min(best[name], timeit.timeit(fn, number=n) / n * 1e9)
    return {"record_ns": best["record"], "wrapper_ns": best["wrapped"] - best["bare"]}


def hang_worker(stamp: Path) -> None:
    """Under dtrain: a few all-reduces, then rank 1 stops (noting when) and rank 0 waits."""
    import torch

    from trainer.comm.bootstrap import init

    world = init(backend="mpi")
    t = torch.ones(8)
    for _ in range(5):
        world.comm.all_reduce(t)
    if world.rank == 1:
        stamp.write_text(repr(time.time()))
        time.sleep(3600)
    world.comm.all_reduce(t)


def hang_to_diagnosis(timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-hang-") as tmp:
        stamp = Path(tmp, "stamp")
        proc = subprocess.Popen(
            [sys.executable, "-m", "launcher", "launch", "--nproc-per-node", "2",
             "--hang-timeout", str(timeout), "--hang-action", "abort", "--grace", "1", "--",
             sys.executable, "-m", "bench.progress", "--hang-worker", str(stamp)],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        seen = None
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith("dtrain: hang:") and seen is None:
                seen = time.time()
        proc.wait(timeout=60)
        if seen is None or not stamp.exists():
            raise RuntimeError(f"no diagnosis for --hang-timeout {timeout} (exit "
                               f"{proc.returncode})")
        latency = seen - float(stamp.read_text())
        return {"hang_timeout_s": timeout, "diagnosis_after_s": latency,
                "beyond_timeout_s": latency - timeout, "exit_code": proc.returncode}


def run(ranks: int = 2, timeouts: Sequence[float] = (2.0, 5.0),
        timeout: float = 300) -> list[dict[str, Any]]:
    sys.path.insert(0, str(REPO))
    from testbed.mpiexec import clean_env, run_mpiexec

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-progress-") as tmp:
        out = Path(tmp, "rows.json")
        proc = run_mpiexec(ranks, [sys.executable, "-m", "bench.progress", "--overhead-worker",
                                   str(out)], timeout=timeout, env=clean_env())
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"overhead run failed:\n{proc.stdout[-3000:]}")
        cost = record_cost_ns(Path(tmp, "single.progress"))
        for row in json.loads(out.read_text()):
            rows.append({"measure": "all_reduce overhead", "ranks": ranks, **row, **cost})
    for t in timeouts:
        rows.append({"measure": "hang to diagnosis", **hang_to_diagnosis(t)})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.progress", description=__doc__)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--timeouts", default="2,5")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--overhead-worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--hang-worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.overhead_worker:
        overhead_worker(args.overhead_worker)
        return 0
    if args.hang_worker:
        hang_worker(args.hang_worker)
        return 0
    rows = run(args.ranks, [float(t) for t in args.timeouts.split(",")])
    for row in rows:
        print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
