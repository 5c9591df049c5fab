"""Tensor parallelism on CPU: what TP=2 sends per step against the analytic count, and its step
time against DP=2 (and one process) for the same model and global batch.

    python -m bench.tp [--model small] [--seq-len 128] [--global-batch 8] [--microbatches 1]
                       [--steps 6] [--json PATH]

Each layout trains with the trainer's own ``build_run``/``train_step`` (AdamW, clipping on,
dropout off) under the MPICH wheel's ``mpiexec``; ``tp2`` and ``dp2`` run in the same two
processes with their steps interleaved (order rotating every round), ``serial`` in one process.
The TP and DP communicators are wrapped in `CountingCommunicator`, so every collective's calls,
bytes and host time are counted where the layers issue them.

Analytic count per step without sequence parallelism, L layers, m microbatches of b sequences
of T tokens, width D, fp32 (Megatron): forward 2 all-reduces of b*T*D per layer (attention and
MLP row-parallel outputs) + 1 (vocab-parallel embedding) + 3 of b*T (the loss: max, target
logit, sum of exp); backward 2 per layer (qkv and fc input gradients) + 1 (head input); plus one
scalar for the global gradient norm. DP=2 all-reduces every gradient once per step (one call
per bucket) plus the logged loss.

Columns: ``step ms`` the median over timed steps of the slowest rank's step; ``TP/DP calls`` and
``MB`` per step, measured (``meas``) and analytic (``calc``); ``comm ms`` host time inside those
collectives per step (median, mean over ranks). On this shared 2-core CPU machine ``comm ms``
includes waiting for the other rank to arrive, so it is an upper bound of transfer time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any

from bench import rankjobs

WARMUP = 2
SUMMARY_COLUMNS = [("layout", "layout"), ("ranks", "ranks"), ("step ms", "step_ms"),
                   ("vs serial", "speedup"), ("TP calls meas", "tp_calls"),
                   ("TP calls calc", "tp_calls_calc"), ("TP MB meas", "tp_mb"),
                   ("TP MB calc", "tp_mb_calc"), ("TP comm ms", "tp_comm_ms"),
                   ("DP calls meas", "dp_calls"), ("DP calls calc", "dp_calls_calc"),
                   ("DP MB meas", "dp_mb"), ("DP MB calc", "dp_mb_calc"),
                   ("DP comm ms", "dp_comm_ms")]
SUMMARY_NOTE = ("TP=2 all-reduces activations (4L+2 per microbatch, b*T*D each) where DP=2 "
                "all-reduces gradients once per step; counts and bytes are measured through a "
                "counting communicator and match the analytic ones exactly. Times are CPU over "
                "MPI on a shared machine, not a GPU forecast.")


def analytic(cfg: Any, *, tp: int, dp: int, buckets: int, grad_numel: int) -> dict[str, float]:
    """Calls and bytes per step on the TP and DP groups (0 for a group of one)."""
    g, m = cfg.gpt, cfg.parallel.microbatches
    b = cfg.data.global_batch // (dp * m)
    act, tokens = b * g.seq_len * g.d_model * 4, b * g.seq_len * 4
    per_micro = 4 * g.n_layer + 2
    out = {"tp_calls_calc": 0, "tp_mb_calc": 0.0, "dp_calls_calc": 0, "dp_mb_calc": 0.0}
    if tp > 1:
        out["tp_calls_calc"] = m * (per_micro + 3) + 1
        out["tp_mb_calc"] = (m * (per_micro * act + 3 * tokens) + 4) / 1e6
    if dp > 1:
        out["dp_calls_calc"] = buckets + 1
        out["dp_mb_calc"] = (grad_numel * 4 + 4) / 1e6
    return out


class Side:
    """One layout built by the trainer, its TP and DP communicators counted."""

    def __init__(self, args: argparse.Namespace, world: Any, tp: int, dp: int,
                 run_dir: str) -> None:
        from trainer.comm.mesh import Mesh
        from trainer.comm.topology import MeshShape
        from trainer.config.options import make_config, resolve_dp
        from trainer.parallel.tensor.counting import CountingCommunicator
        from trainer.training.run import build_run

        mesh = Mesh.build(world.comm, MeshShape(dp=dp, tp=tp), world.device)
        self.tp_count = CountingCommunicator(mesh.group("tp"))
        self.dp_count = CountingCommunicator(mesh.group("dp"))
        counters = {("tp",): self.tp_count, ("ep", "edp"): self.dp_count}
        counted = mesh.wrapped(lambda axes, comm: counters.get(axes, comm))
        cfg = make_config({"model": args.model, "global_batch": args.global_batch,
                           "microbatches": args.microbatches, "tp": tp, "dp": dp,
                           "steps": WARMUP + args.steps, "lr": 1e-4, "warmup_steps": 1,
                           "data_cap_mb": 1.0, "run_dir": run_dir, "seed": 0},
                          {"seq_len": args.seq_len})
        self.cfg = resolve_dp(cfg, world.size)
        self.run = build_run(self.cfg, counted)
        self.name, self.tp, self.dp = f"tp{tp}" if tp > 1 else f"dp{dp}", tp, dp
        self.steps: list[dict[str, float]] = []

    def step(self, i: int, timed: bool) -> None:
        from trainer.training.step import train_step

        self.tp_count.reset()
        self.dp_count.reset()
        start = time.perf_counter()
        train_step(self.run, i)
        if timed:
            tp, dp = self.tp_count.total(), self.dp_count.total()
            self.steps.append({"step_s": time.perf_counter() - start, "tp_calls": tp.calls,
                               "tp_bytes": tp.bytes, "tp_s": tp.seconds, "dp_calls": dp.calls,
                               "dp_bytes": dp.bytes, "dp_s": dp.seconds})

    def summary(self) -> dict[str, Any]:
        return {"layout": self.name, "tp": self.tp, "dp": self.dp, "steps": self.steps,
                **analytic(self.cfg, tp=self.tp, dp=self.dp, buckets=len(self.run.dp.buckets),
                           grad_numel=self.run.dp.buffer.numel())}


def worker(args: argparse.Namespace) -> dict[str, Any]:
    from trainer.comm.bootstrap import init

    world = init(backend="mpi")
    layouts = [(2, 1), (1, 2)] if world.size == 2 else [(1, 1)]
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-tp-") as tmp:
        sides = [Side(args, world, tp, dp, f"{tmp}/tp{tp}dp{dp}") for tp, dp in layouts]
        rankjobs.interleave(world, sides, warmup=WARMUP, steps=args.steps)
    return {"rank": world.rank, "sides": [s.summary() for s in sides]}


def _ranks(n: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    return rankjobs.rank_results("bench.tp", n, args,
                                 ("model", "seq_len", "global_batch", "microbatches", "steps"))


def summarize(per_rank: list[dict[str, Any]], index: int) -> dict[str, Any]:
    """Medians over the timed steps: slowest rank's step time, per-step counts of rank 0
    (every rank issues the same collectives), comm time averaged over ranks."""
    sides = [r["sides"][index] for r in per_rank]
    steps = list(zip(*(s["steps"] for s in sides), strict=True))  # [step][rank]
    med = statistics.median
    first = sides[0]
    row = {"layout": first["layout"] if len(per_rank) > 1 else "serial",
           "ranks": len(per_rank),
           "step_ms": 1e3 * med(max(r["step_s"] for r in s) for s in steps)}
    for group in ("tp", "dp"):
        size = first[group]
        row[f"{group}_calls"] = statistics.median_low(s[0][f"{group}_calls"] for s in steps) \
            if size > 1 else 0
        row[f"{group}_mb"] = med(s[0][f"{group}_bytes"] for s in steps) / 1e6 if size > 1 \
            else 0.0
        row[f"{group}_comm_ms"] = 1e3 * med(statistics.mean(r[f"{group}_s"] for r in s)
                                            for s in steps) if size > 1 else 0.0
        row[f"{group}_calls_calc"] = first[f"{group}_calls_calc"]
        row[f"{group}_mb_calc"] = first[f"{group}_mb_calc"]
    return row


def run(**options: Any) -> list[dict[str, Any]]:
    """Rows for tp2, dp2 (2 ranks) and serial (1 process), with the speedup over serial."""
    args = parse_args(rankjobs.as_argv(options))
    two = _ranks(2, args)
    rows = [summarize(two, i) for i in range(len(two[0]["sides"]))]
    rows.append(summarize(_ranks(1, args), 0))
    serial = rows[-1]["step_ms"]
    for row in rows:
        row["speedup"] = serial / row["step_ms"]
        row.update(model=args.model, seq_len=args.seq_len, global_batch=args.global_batch,
                   microbatches=args.microbatches)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    r0 = rows[0]
    table = Table(title=f"TP=2 vs DP=2 on CPU ({r0['model']} GPT, seq {r0['seq_len']}, "
                        f"global batch {r0['global_batch']}, {r0['microbatches']} microbatch(es))")
    for head, _ in SUMMARY_COLUMNS:
        table.add_column(head, justify="right")
    for row in rows:
        cells = []
        for _, key in SUMMARY_COLUMNS:
            value = row[key]
            cells.append(f"{value:.2f}" if isinstance(value, float) else str(value))
        table.add_row(*cells)
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.tp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="GPT preset")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6, help="timed steps (after 2 warmup steps)")
    rankjobs.add_worker_options(ap, timeout=600)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return rankjobs.main(parse_args(argv), worker, run, print_table)


if __name__ == "__main__":
    sys.exit(main())
