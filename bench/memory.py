"""Memory per rank of each memory technique against the analytic table, and what it costs.

    python -m bench.memory [--model small] [--seq-len 128] [--global-batch 8] [--steps 4]
                           [--bucket-size 250000] [--json PATH]

Every row (`ROWS`) is a layout trained with the trainer's own ``build_run``/``train_step``
(fp32, AdamW, clipping on) under the MPICH wheel's ``mpiexec``; the rows of one world size run
in the same processes with their steps interleaved (order rotating every round), so they see
the same machine load. Measured per rank (the largest rank), in MiB:

* ``params``, ``grads``, ``optim``: the bytes of the tensors the rank holds
  (`trainer.parallel.zero.memory.held_bytes`: parameters, the gradient buffer, main copies and AdamW
  state), with ``grads calc`` and ``optim calc`` from Megatron's bytes-per-parameter table for
  the same rank (`trainer.parallel.zero.memory.expected_bytes`); ``grads peak``: the most gradient
  memory during a step, the buffer plus, under ZeRO-2/3, the buckets staged while backward
  fills and reduces them (`trainer.parallel.zero.grad_shards`); ``params peak``: likewise the
  parameters plus, under ZeRO-3 (whose ``params`` are the shards), the units gathered at once
  (`trainer.parallel.zero.units`);
* ``activations``: the peak of the bytes autograd holds for backward during a step (every
  saved tensor counted once, from a ``saved_tensors_hooks`` meter), pipelines included;
* ``total``: params + grads + optim + activations, the rank's training memory (peak RSS is not
  shown: rows that share a process share it).

Time: ``step ms`` is the median over timed steps of the slowest rank's step; ``vs dp2`` its
ratio to plain dp2 (the ZeRO-1 target is <= 1.05); ``exposed ms`` the DP communication the step
waited for (`trainer.comm.timing`: the reduce-scatter or all-reduce not hidden behind backward,
plus ZeRO-1's all-gather after the step), next to the same with ``overlap on``. The rows
without it take the trainer's default (`trainer.parallel.data.buckets.reduction_schedule`: on
MPI without a core to spare per rank, the reductions run after backward); each row records the
``overlap`` it ran with.

More rows: add an entry to `ROWS` (config overrides; rows of one world size share processes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WARMUP = 1
MIB = 2**20
#: Row name -> (world size, TrainConfig overrides).
ROWS: dict[str, tuple[int, dict[str, Any]]] = {
    "serial": (1, {"dp": 1}),
    "dp2": (2, {"dp": 2}),
    "dp2+zero1": (2, {"dp": 2, "zero": 1}),
    "dp2+zero2": (2, {"dp": 2, "zero": 2}),
    "dp2+zero3": (2, {"dp": 2, "zero": 3}),
    "dp2 overlap on": (2, {"dp": 2, "overlap": True}),
    "dp2+zero1 overlap on": (2, {"dp": 2, "zero": 1, "overlap": True}),
    "dp2+zero2 overlap on": (2, {"dp": 2, "zero": 2, "overlap": True}),
    "tp2": (2, {"dp": 1, "tp": 2}),
    "pp2": (2, {"dp": 1, "pp": 2, "microbatches": 4}),
    "tp2+sp": (2, {"dp": 1, "tp": 2, "sequence_parallel": True}),
    "tp2+recompute full": (2, {"dp": 1, "tp": 2, "recompute": "full"}),
    "dp2+recompute selective": (2, {"dp": 2, "recompute": "selective"}),
}
COLUMNS = [("layout", "layout"), ("ranks", "ranks"), ("params", "params_mib"),
           ("params peak", "params_peak_mib"),
           ("grads", "grads_mib"), ("grads peak", "grads_peak_mib"), ("grads calc",
                                                                    "grads_calc_mib"),
           ("optim", "optim_mib"), ("optim calc", "optim_calc_mib"),
           ("activations", "act_mib"), ("total", "total_mib"), ("step ms", "step_ms"),
           ("vs dp2", "vs_dp2"), ("exposed ms", "exposed_ms")]
SUMMARY_COLUMNS = COLUMNS
SUMMARY_NOTE = ("MiB per rank (largest rank) of fp32 training: held tensors measured, 'calc' "
                "from Megatron's bytes-per-parameter table (gradients 4 per parameter, 4/dp "
                "with ZeRO-2; optimizer 8, 8/dp with ZeRO-1 and 2); 'grads peak' adds ZeRO-2's "
                "staged buckets during a step; activations = peak bytes saved for backward. "
                "Times are CPU over MPI on a shared machine; 'vs dp2' is the ZeRO cost (target "
                "<= 1.05).")


class Side:
    """One row's layout built by the trainer in this world."""

    def __init__(self, args: argparse.Namespace, world: Any, name: str, over: dict[str, Any],
                 run_dir: str) -> None:
        from trainer.config.options import make_config
        from trainer.training.run import build_run, mesh_for

        self.cfg = make_config({"model": args.model, "global_batch": args.global_batch,
                                "steps": WARMUP + args.steps, "lr": 1e-4, "warmup_steps": 1,
                                "data_cap_mb": 1.0, "run_dir": run_dir, "seed": 0,
                                "bucket_size": args.bucket_size, "precision": "fp32",
                                "eval_every": 0, **over}, {"seq_len": args.seq_len})
        self.run = build_run(self.cfg, mesh_for(self.cfg, world))
        self.name, self.steps, self.act, self.staged, self.gathered = name, [], 0, 0, 0

    def step(self, i: int, timed: bool) -> None:
        import torch

        from trainer.parallel.zero.memory import SavedTensorMeter
        from trainer.training.step import train_step

        meter = SavedTensorMeter()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            rec = train_step(self.run, i)
        if timed:
            self.steps.append({"step_s": time.perf_counter() - start,
                               "exposed_s": rec.comm_exposed_s})
            self.act = max(self.act, meter.peak)
            self.staged = max(self.staged, getattr(self.run.dp, "peak_staged_bytes", 0))
            units = getattr(self.run.weights, "units", None)
            if units is not None:
                self.gathered = max(self.gathered, units.peak_gathered_bytes)
                units.peak_gathered_bytes = units.gathered_bytes

    def summary(self) -> dict[str, Any]:
        from trainer.parallel.zero.memory import expected_bytes, held_bytes

        run = self.run
        units = getattr(run.weights, "units", None)  # ZeRO-3: the shards are the parameters
        held = held_bytes(run.model.parameters() if units is None else units.shards,
                          run.dp.buffer, run.weights.optimizer)
        params = held.params
        n = sum(p.numel() for p in run.dp.params)
        calc = expected_bytes(n, bf16=False, zero=self.cfg.optimizer.zero, dp=self.cfg.parallel.dp)
        return {"layout": self.name, "overlap": run.cfg.parallel.overlap,
                "steps": self.steps, "params": params,
                "params_peak": params + self.gathered, "grads": held.grads,
                "grads_peak": held.grads + self.staged,
                "grads_calc": calc.grads, "optim": held.optimizer,
                "optim_calc": calc.optimizer, "act": self.act}


def worker(args: argparse.Namespace) -> dict[str, Any]:
    from trainer.comm.bootstrap import init

    world = init(backend="mpi")
    rows = [(name, over) for name, (n, over) in ROWS.items() if n == world.size]
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-memory-") as tmp:
        sides = [Side(args, world, name, over, f"{tmp}/{k}")
                 for k, (name, over) in enumerate(rows)]
        for i in range(1, WARMUP + args.steps + 1):
            for side in sides[i % len(sides):] + sides[:i % len(sides)]:
                world.comm.barrier()  # every rank starts the step together
                side.step(i, timed=i > WARMUP)
    return {"rank": world.rank, "sides": [s.summary() for s in sides]}


def _ranks(n: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    sys.path.insert(0, str(REPO))
    from testbed.mpiexec import clean_env, run_mpiexec

    with tempfile.TemporaryDirectory(prefix="dtrain-bench-memory-out-") as out:
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("model", "seq_len", "global_batch", "steps", "bucket_size")]
        proc = run_mpiexec(n, [sys.executable, "-m", "bench.memory", "--worker", "--out", out,
                               *flags], timeout=args.timeout, env=clean_env())
        files = sorted(Path(out).glob("rank*.json"))
        if proc.returncode != 0 or len(files) != n:
            raise RuntimeError(f"bench.memory on {n} ranks failed:\n{proc.stdout[-3000:]}")
        return [json.loads(f.read_text()) for f in files]


def summarize(per_rank: list[dict[str, Any]], index: int) -> dict[str, Any]:
    """The largest rank's bytes; medians over steps of the slowest rank's time."""
    sides = [r["sides"][index] for r in per_rank]
    steps = list(zip(*(s["steps"] for s in sides), strict=True))  # [step][rank]
    med = statistics.median
    row: dict[str, Any] = {"layout": sides[0]["layout"], "ranks": len(per_rank),
                           "overlap": sides[0]["overlap"]}
    for key in ("params", "params_peak", "grads", "grads_peak", "grads_calc", "optim",
                "optim_calc", "act"):
        row[f"{key}_mib"] = max(s[key] for s in sides) / MIB
    row["total_mib"] = max(s["params"] + s["grads"] + s["optim"] + s["act"] for s in sides) / MIB
    row["step_ms"] = 1e3 * med(max(r["step_s"] for r in s) for s in steps)
    row["exposed_ms"] = 1e3 * med(max(r["exposed_s"] for r in s) for s in steps)
    return row


def run(**options: Any) -> list[dict[str, Any]]:
    """One row per `ROWS` entry, with step time relative to dp2."""
    args = parse_args([f"--{k.replace('_', '-')}={v}" for k, v in options.items()])
    rows = []
    for n in sorted({n for n, _ in ROWS.values()}):
        got = _ranks(n, args)
        rows += [summarize(got, i) for i in range(len(got[0]["sides"]))]
    dp2 = next((r["step_ms"] for r in rows if r["layout"] == "dp2"), None)
    for row in rows:
        row["vs_dp2"] = row["step_ms"] / dp2 if dp2 else 0.0
        row.update(model=args.model, seq_len=args.seq_len, global_batch=args.global_batch)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    from bench.common import rich_table

    r0 = rows[0]
    rich_table(f"Memory per rank, MiB, fp32 ({r0['model']} GPT, seq {r0['seq_len']}, "
               f"global batch {r0['global_batch']})",
               COLUMNS, rows, digits=2, width=200)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="GPT preset")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="timed steps (after 1 warmup step)")
    ap.add_argument("--bucket-size", type=int, default=250_000)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    from bench import common

    return common.rank_bench_main(args, run, worker, print_table)


if __name__ == "__main__":
    sys.exit(main())
