"""Pipeline schedules on equal-cost stages: measured bubble vs theory, activation memory, step time.

    python -m bench.pipeline [--ps 2,4] [--ms 4,8,16] [--v 2] [--forward-ms 50] [--reps 3]
                             [--act-mb 4] [--polite 1] [--results DIR]

Each pipeline size p runs as p ranks under the MPICH wheel's ``mpiexec``; every rank executes
its action list with `trainer.parallel.pipeline.runtime.run_schedule` over MPI. The stages are
synthetic
and equal-cost: a forward *sleeps* ``forward_ms / v`` per chunk and a backward twice that
(sleeping keeps the cost fixed on a machine with fewer cores than ranks, where a matmul would
measure CPU contention instead of the schedule). Each stage boundary is a real (64, 1024) fp32
tensor sent with ``batch_p2p``, and each forward really allocates and keeps a "saved activation"
of ``act_mb / v`` MB until its backward, reported to the runtime through
``Stage.activation_bytes``. Ranks wait for p2p by polling with 100 us sleeps (``--polite 0``:
MPI's spinning wait), so on a host with fewer free cores than ranks the waiting ranks do not
take the CPU that a waking rank needs.

The theory ignores p2p latency; here every p2p batch costs a wake-up and a copy on a shared
host (0.1 ms round trip unloaded, a few ms under load), so the measured bubble sits above the
theory by roughly (p2p batches on the critical path x latency) / compute. Longer stages
(``--forward-ms``) bring it closer.

Per (p, m, schedule) one warm-up step, then ``reps`` timed steps (schedules rotated each round);
the row is the median step. Columns:

* ``bubble``: measured idle / compute time, mean over ranks (idle = the step's span minus the
  rank's F and B time; p2p waits are idle), against ``theory`` = (p-1)/m, or (p-1)/(v*m)
  interleaved; ``ideal`` is the same schedule's bubble in `check_schedule`'s ideal run;
* ``peak_act_mb``: the most saved-activation memory any rank held (rank 0 for these
  schedules) and ``mem_vs_gpipe`` its ratio to GPipe's at the same p and m, against the 1F1B
  target ``p/m``;
* ``step_ms`` and ``vs_1f1b``: median step time and its ratio to 1F1B's.

Writes ``bench/results/pipeline_timeline.png`` (the three schedules at the largest p and
m = 8, stacked on one time axis), one Gantt PNG and one Chrome trace per schedule at that size.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
SCHEDULES = ("gpipe", "1f1b", "interleaved")
BOUNDARY = (64, 1024)  # fp32 activation crossing ranks: 256 KiB

SUMMARY_COLUMNS = [("p", "p"), ("m", "m"), ("schedule", "schedule"), ("step ms", "step_ms"),
                   ("vs 1F1B", "vs_1f1b"), ("bubble", "bubble"), ("theory", "theory"),
                   ("ideal", "ideal"), ("peak act MB", "peak_act_mb"),
                   ("vs GPipe", "mem_vs_gpipe"), ("target p/m", "mem_target"),
                   ("in flight", "in_flight")]
SUMMARY_NOTE = ("bubble = idle / compute time per rank (mean over ranks); theory (p-1)/m, "
                "interleaved (p-1)/(v*m). Memory target: 1F1B <= p/m of GPipe's peak.")


class SleepStage:
    """Equal-cost synthetic chunks: sleep for the compute, keep a real saved activation."""

    def __init__(self, p: int, v: int, rank: int, forward_s: float, act_mb: float) -> None:
        import torch

        self.torch = torch
        self.last = (rank == p - 1)
        self.p, self.v, self.rank = p, v, rank
        self.forward_s = forward_s / v
        self.saved_elems = int(act_mb * 2**20 / 4 / v)
        self.saved: dict[tuple[int, int], Any] = {}

    def _is_last(self, chunk: int) -> bool:
        return self.last and chunk == self.v - 1

    def forward(self, mb: int, chunk: int, x: Any) -> Any:
        time.sleep(self.forward_s)
        self.saved[(mb, chunk)] = self.torch.ones(self.saved_elems)
        if self._is_last(chunk):
            return self.torch.zeros(())
        return self.torch.full(BOUNDARY, float(mb))

    def backward(self, mb: int, chunk: int, grad: Any) -> Any:
        time.sleep(2 * self.forward_s)
        del self.saved[(mb, chunk)]
        return self.torch.full(BOUNDARY, float(mb))

    def activation_bytes(self, mb: int, chunk: int) -> int:
        return self.saved[(mb, chunk)].nbytes


# -- worker (one rank under mpiexec) ---------------------------------------------------------


def polite_wait(handles: Sequence[Any]) -> None:
    """Wait for p2p handles without spinning: MPI's blocking wait busy-polls, which on a host
    with more ranks than free cores steals the CPU that the other ranks need to progress."""
    while not all(h.is_completed() for h in handles):
        time.sleep(100e-6)
    for h in handles:
        h.wait()


def _step(comm: Any, name: str, m: int, v: int, args: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import asdict

    from trainer.comm.protocol import wait_all
    from trainer.parallel.pipeline.runtime import P2PSpec, run_schedule
    from trainer.parallel.pipeline.schedule import build, chunks_of
    from trainer.parallel.pipeline.timeline import gather

    v = chunks_of(name, v)
    actions = build(name, comm.size, m, v)[comm.rank]
    stage = SleepStage(comm.size, v, comm.rank, args.forward_ms / 1e3, args.act_mb)
    wait = polite_wait if args.polite else wait_all
    result = run_schedule(actions, stage, comm, P2PSpec(BOUNDARY), v=v, wait=wait)
    events = gather(comm, result.timeline)  # collective: every rank gathers, rank 0 keeps them
    return {"events": [asdict(e) for e in events] if comm.rank == 0 else [],
            "peak": result.peak_activation_bytes, "in_flight": result.max_in_flight}


def worker(args: argparse.Namespace) -> dict[str, Any]:
    from trainer.comm.bootstrap import init

    comm = init(backend="mpi").comm
    runs: dict[str, list[dict[str, Any]]] = {}
    for m in args.ms:
        for rep in range(args.reps + 1):  # round 0 warms up (first backward, MPI buffers)
            k = rep % len(SCHEDULES)
            for name in SCHEDULES[k:] + SCHEDULES[:k]:
                got = _step(comm, name, m, args.v, args)
                if rep > 0:
                    runs.setdefault(f"{name}/{m}", []).append(got)
    return {"rank": comm.rank, "runs": runs}


# -- driver ----------------------------------------------------------------------------------


def _ranks(p: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    sys.path.insert(0, str(REPO))
    from testbed.mpiexec import clean_env, run_mpiexec

    with tempfile.TemporaryDirectory(prefix="dtrain-bench-pp-") as tmp:
        flags = [f"--ms={','.join(map(str, args.ms))}", f"--v={args.v}",
                 f"--forward-ms={args.forward_ms}", f"--act-mb={args.act_mb}",
                 f"--reps={args.reps}", f"--polite={int(args.polite)}"]
        proc = run_mpiexec(p, [sys.executable, "-m", "bench.pipeline", "--worker", "--out", tmp,
                               *flags], timeout=args.timeout, env=clean_env())
        files = sorted(Path(tmp).glob("rank*.json"))
        if proc.returncode != 0 or len(files) != p:
            raise RuntimeError(f"bench.pipeline on {p} ranks failed:\n{proc.stdout[-3000:]}")
        return [json.loads(f.read_text()) for f in files]


def _row(p: int, m: int, name: str, v: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    from trainer.parallel.pipeline.check import check_schedule
    from trainer.parallel.pipeline.schedule import build, chunks_of
    from trainer.parallel.pipeline.timeline import Event, bubble, theory

    v = chunks_of(name, v)
    steps = per_rank[0]["runs"][f"{name}/{m}"]
    stats = [bubble([Event(**e) for e in s["events"]], p) for s in steps]
    median = sorted(range(len(steps)), key=lambda i: stats[i].span)[len(steps) // 2]
    ideal = check_schedule(build(name, p, m, v), p, v, m=m, cost_f=1 / v, cost_b=2 / v).bubble
    peaks = [r["runs"][f"{name}/{m}"][median]["peak"] for r in per_rank]
    return {"p": p, "m": m, "schedule": name if v == 1 else f"{name} v={v}", "v": v,
            "step_ms": 1e3 * stats[median].span,
            "bubble": stats[median].mean_idle_over_busy, "theory": theory(name, p, m, v),
            "ideal": ideal, "idle_of_step": stats[median].mean_idle_over_span,
            "peak_act_mb": max(peaks) / 2**20,
            "in_flight": per_rank[0]["runs"][f"{name}/{m}"][median]["in_flight"],
            "events": steps[median]["events"]}


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    by = {(r["p"], r["m"], r["schedule"].split()[0]): r for r in rows}
    for r in rows:
        gp, ofb = by[(r["p"], r["m"], "gpipe")], by[(r["p"], r["m"], "1f1b")]
        r["vs_1f1b"] = r["step_ms"] / ofb["step_ms"]
        r["mem_vs_gpipe"] = r["peak_act_mb"] / gp["peak_act_mb"]
        r["mem_target"] = r["p"] / r["m"] if r["schedule"] == "1f1b" else None


def _pictures(rows: list[dict[str, Any]], results: Path) -> None:
    from trainer.parallel.pipeline.timeline import Event, write_chrome_trace, write_gantt

    p = max(r["p"] for r in rows)
    m = 8 if any(r["m"] == 8 for r in rows) else max(r["m"] for r in rows)
    panels = []
    for r in rows:
        if (r["p"], r["m"]) != (p, m):
            continue
        events = [Event(**e) for e in r["events"]]
        title = f"{r['schedule']}, p={p}, m={m}"
        tag = r["schedule"].split()[0]
        write_gantt(results / f"pipeline_{tag}_p{p}_m{m}.png", events, title=title)
        write_chrome_trace(results / f"pipeline_{tag}_p{p}_m{m}.trace.json", events, title=title)
        panels.append((title, events))
    write_gantt(results / "pipeline_timeline.png", [], panels=panels)


def run(ps: Sequence[int] = (2, 4), ms: Sequence[int] = (4, 8, 16), v: int = 2,
        forward_ms: float = 50.0, act_mb: float = 4.0, reps: int = 3, polite: bool = True,
        timeout: float = 500, results: Path | str = RESULTS,
        progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One row per (p, m, schedule); pictures of the largest p at m = 8 go to ``results``."""
    args = argparse.Namespace(ms=list(ms), v=v, forward_ms=forward_ms, act_mb=act_mb, reps=reps,
                              polite=polite, timeout=timeout)
    rows = []
    for p in ps:
        if progress:
            progress(f"p={p}: {len(ms)} microbatch counts x {len(SCHEDULES)} schedules")
        per_rank = _ranks(p, args)
        rows += [_row(p, m, name, v, per_rank) for m in ms for name in SCHEDULES]
    _add_ratios(rows)
    _pictures(rows, Path(results))
    for r in rows:
        del r["events"]
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    from bench.common import print_rows

    print_rows("Pipeline schedules, equal-cost sleep stages (B = 2 F)", rows, SUMMARY_COLUMNS)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--ps", type=ints, default=[2, 4], help="pipeline sizes, e.g. 2,4")
    ap.add_argument("--ms", type=ints, default=[4, 8, 16], help="microbatch counts")
    ap.add_argument("--v", type=int, default=2, help="chunks per rank for interleaved 1F1B")
    ap.add_argument("--forward-ms", type=float, default=50.0, help="forward time of one stage")
    ap.add_argument("--act-mb", type=float, default=4.0, help="saved activation per stage, MB")
    ap.add_argument("--reps", type=int, default=3, help="timed steps per configuration")
    ap.add_argument("--polite", type=int, default=1, help="1: poll p2p with short sleeps")
    ap.add_argument("--timeout", type=float, default=500)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    from bench import common

    if args.worker:
        return common.save_rank_result(args.out, worker(args))
    rows = run(args.ps, args.ms, args.v, args.forward_ms, args.act_mb, args.reps,
               bool(args.polite), args.timeout, args.results, progress=print)
    print_table(rows)
    print(f"pictures: {args.results}/pipeline_timeline.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
