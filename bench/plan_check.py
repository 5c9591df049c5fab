"""The layout planner against the trainer on this machine: memory per rank, bytes sent per step
and step time, planned and measured, for each layout of `ROWS`.

    python -m bench.plan_check [--model tiny,small] [--seq-len 128] [--global-batch 8] [--steps 3]
                               [--json PATH]

Every row is trained with the trainer's own ``build_run``/``train_step`` (fp32) on 2 ranks
(4 for the rows of `WORLDS`) under the MPICH wheel's ``mpiexec``, the world communicator wrapped in
`trainer.plan.traffic.CountedCommunicator` (so every group counts what it sends, as the planner
prices it). Measured per step and rank, the largest rank kept:

* memory: the tensors held after the step (`held_bytes`, as `bench.memory`), ZeRO-2/3's staged
  gradients and gathered units at their peaks (`bench.memory`'s ``grads peak`` and ``params
  peak``), plus the peak bytes saved for backward during it (`SavedTensorMeter`;
  `trainer.training.plan_check.measured_bytes`);
* bytes sent per step by kind (dp, tp, pp, ep, cp), mean over the timed steps;
* step time: the median over timed steps of the slowest rank's step;
* the first (warmup) step's memory and ep bytes apart, against the plan of step 1: a mixture
  of experts' plan routes the run's batches through its initial router, which the timed steps
  have trained a step or more (``mem_first``, ``ep_first``).

The planner (`trainer.plan.estimate`) is given this machine as its cluster, every number
measured here by a microbenchmark on each rank with both ranks at once (so as loaded as the
layouts), none fitted to the steps it is compared with: the peak fp32 matmul FLOP/s of one core
(`trainer.health.perf.matmul_gflops`, efficiency 1), the copy bandwidth of its memory
(`copy_gbps`), the host seconds per tensor operation (`trainer.plan.operations.op_seconds`),
and the bus bandwidth of a 2-rank all-reduce of 4 MiB and the latency per message step of one
of 4 bytes (`trainer.comm.bandwidth`), inside and between "hosts" alike. Rows of more ranks
than cores share the FLOP/s, bandwidth and host time. ``plan ms, serial FLOP/s``: the same
with the matmul FLOP/s of the serial step measured here (each rank alone, both at once): its
counted FLOPs over its time less the host operations and memory traffic the planner prices
apart (the CPU described by a step that is none of the rows). ``--model tiny,small`` runs the
rows for each model in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CORES = len(os.sched_getaffinity(0))
WARMUP = 1
MIB = 2**20
KINDS = ("dp", "tp", "pp", "ep", "cp")
#: Row name -> TrainConfig overrides (2 ranks each, but those of `WORLDS`).
ROWS: dict[str, dict[str, Any]] = {
    "dp2": {"dp": 2},
    "tp2": {"dp": 1, "tp": 2},
    "pp2 1f1b": {"dp": 1, "pp": 2, "microbatches": 4, "schedule": "1f1b"},
    "dp2+zero1": {"dp": 2, "zero": 1},
    "tp2+sp": {"dp": 1, "tp": 2, "sequence_parallel": True},
    "tp2+recompute full": {"dp": 1, "tp": 2, "recompute": "full"},
    "dp2+recompute selective": {"dp": 2, "recompute": "selective"},
    "ep2 moe": {"dp": 2, "ep": 2, "moe_experts": 4, "moe_topk": 2,
                "moe_capacity_factor": 1.0},
    "dp2+zero2": {"dp": 2, "zero": 2},
    "dp2+zero3": {"dp": 2, "zero": 3},
    "cp2": {"dp": 1, "cp": 2},
    "cp2 ring+recompute selective": {"dp": 1, "cp": 2, "cp_comm": "ring",
                                     "recompute": "selective"},
    # 4 layers, so that ZeRO-3 gathers some of the blocks at a time, not all
    "dp4+zero3": {"dp": 4, "zero": 3, "n_layer": 4},
    "dp4+zero3 shard2": {"dp": 4, "zero": 3, "n_layer": 4, "zero_shard_size": 2},
}
WORLDS: dict[str, int] = {"dp4+zero3": 4, "dp4+zero3 shard2": 4}
"""Rows of more than 2 ranks (their own mpiexec; the machine is measured on 2)."""


def config(args: argparse.Namespace, over: dict[str, Any], run_dir: str = "",
           world: int = 2) -> Any:
    from trainer.config.options import make_config, resolve_dp

    cfg = make_config({"model": args.model, "global_batch": args.global_batch,
                       "steps": WARMUP + args.steps, "lr": 1e-4, "warmup_steps": 1,
                       "data_cap_mb": 1.0, "run_dir": run_dir or "unused", "seed": 0,
                       "precision": "fp32", "eval_every": 0, "plan_routing": True, **over},
                      {"seq_len": args.seq_len})
    return resolve_dp(cfg, world)


def _side(args: argparse.Namespace, world: Any, sent: Any, over: dict[str, Any],
          run_dir: str) -> dict[str, Any]:
    """One layout trained on ``world``: its steps' times, memory and bytes sent."""
    import torch

    from trainer.parallel.zero.memory import SavedTensorMeter
    from trainer.training.plan_check import measured_bytes
    from trainer.training.run import build_run, mesh_for
    from trainer.training.step import train_step

    cfg = config(args, over, run_dir, world.size)
    run = build_run(cfg, mesh_for(cfg, world))
    steps, memory, traffic, first = [], 0, [], {}
    units = getattr(run.weights, "units", None)  # ZeRO-3: its peak of gathered units
    for i in range(1, WARMUP + args.steps + 1):
        world.comm.barrier()  # every rank starts the step together
        sent.take()
        if units is not None:
            units.peak_gathered_bytes = units.gathered_bytes
        meter = SavedTensorMeter()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            train_step(run, i)
        elapsed = time.perf_counter() - start
        if i > WARMUP:
            steps.append(elapsed)
            traffic.append(sent.take())
            memory = max(memory, measured_bytes(run, meter.peak))
        else:  # the run's first step: the one a mixture of experts' plan routes by default
            took = sent.take()
            first = {"memory": measured_bytes(run, meter.peak),
                     "sent": {k: took.get(k, 0.0) for k in KINDS}}
    return {"steps": steps, "memory": memory, "first": first,
            "overlap": run.cfg.parallel.overlap,  # as the run chose it on this host
            "sent": {k: statistics.mean(t.get(k, 0.0) for t in traffic) for k in KINDS}}


def worker(args: argparse.Namespace) -> dict[str, Any]:
    from trainer.comm.bandwidth import measure_allreduce
    from trainer.comm.bootstrap import init
    from trainer.health.perf import copy_gbps, matmul_gflops
    from trainer.plan.operations import op_seconds
    from trainer.plan.traffic import CountedCommunicator, SentBytes

    world = init(backend="mpi")
    sent = SentBytes()
    counted = replace(world, comm=CountedCommunicator(world.comm, sent))
    if world.size != 2:  # the rows of a larger world only
        with tempfile.TemporaryDirectory(prefix="dtrain-bench-plan-") as tmp:
            return {"rank": world.rank, "rows": {
                name: _side(args, counted, sent, over, f"{tmp}/{k}")
                for k, (name, over) in enumerate(ROWS.items())
                if WORLDS.get(name, 2) == world.size}}
    width = config(args, {}).gpt.d_model
    # This CPU as the planner's cluster, every number measured here, on each rank with both
    # ranks at once (as loaded as in the layouts): matmul FLOP/s, memory bandwidth, host
    # seconds per tensor operation, and the all-reduce's bandwidth and latency (a 4-byte
    # all-reduce of 2 ranks is 2 message steps).
    machine = {"gflops": matmul_gflops(world.device, n=max(64, width), seconds=0.5),
               "copy_gbps": copy_gbps(world.device),
               "op_s": op_seconds(),
               "busbw_gbps": measure_allreduce(world.comm, 4 * 2**20, device=world.device,
                                               iters=10).busbw_gbps,
               "latency_s": measure_allreduce(world.comm, 4, device=world.device,
                                              iters=50).seconds / 2}
    rows = {}
    # Each rank alone (both at once, as loaded as in the layouts): the serial step, whose
    # FLOP/s (net of what the planner prices apart) is the other description of this CPU.
    alone = replace(world, comm=world.comm.split(world.rank, 0, name="alone"), rank=0, size=1,
                    local_size=1)
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-plan-") as tmp:
        serial = _side(args, alone, SentBytes(), {"dp": 1}, f"{tmp}/serial")
        machine["serial_step_s"] = statistics.median(serial["steps"])
        for k, (name, over) in enumerate(ROWS.items()):
            if name not in WORLDS:
                rows[name] = _side(args, counted, sent, over, f"{tmp}/{k}")
    return {"rank": world.rank, "machine": machine, "rows": rows}


def _ranks(args: argparse.Namespace, n: int = 2) -> list[dict[str, Any]]:
    sys.path.insert(0, str(REPO))
    from testbed.mpiexec import clean_env, run_mpiexec

    with tempfile.TemporaryDirectory(prefix="dtrain-bench-plan-out-") as out:
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("model", "seq_len", "global_batch", "steps")]
        proc = run_mpiexec(n, [sys.executable, "-m", "bench.plan_check", "--worker", "--out",
                               out, *flags], timeout=args.timeout, env=clean_env())
        files = sorted(Path(out).glob("rank*.json"))
        if proc.returncode != 0 or len(files) != n:
            raise RuntimeError(f"bench.plan_check failed:\n{proc.stdout[-3000:]}")
        return [json.loads(f.read_text()) for f in files]


def planned(args: argparse.Namespace, over: dict[str, Any], machine: dict[str, float],
            world: int = 2, steps: tuple[int, ...] = ()) -> Any:
    """The planner's estimate of a row on this CPU (``machine``: the measured numbers; where a
    row runs more ranks than there are cores, they share its FLOP/s, bandwidth and time)."""
    from trainer.plan.cluster import make_cluster
    from trainer.plan.estimate import estimate

    share = min(1.0, CORES / world) / min(1.0, CORES / 2)  # measured with 2 ranks at once
    cluster = make_cluster(hosts=1, gpus_per_host=world, memory_gib=1024,
                           tflops=machine["gflops"] * share / 1e3,
                           intra_gbps=machine["busbw_gbps"], inter_gbps=machine["busbw_gbps"],
                           memory_gbps=machine["copy_gbps"] * share,
                           op_us=1e6 * machine["op_s"] / share,
                           intra_latency_us=1e6 * machine["latency_s"],
                           inter_latency_us=1e6 * machine["latency_s"], host_overlaps=False)
    # The traffic of the steps measured (the timed ones): the experts' all-to-all depends on
    # each step's data (`trainer.plan.routing`).
    return estimate(config(args, over, world=world), replace(cluster, name="cpu"),
                    efficiency=1.0,
                    steps=steps or tuple(range(WARMUP + 1, WARMUP + args.steps + 1)))


def run(**options: Any) -> list[dict[str, Any]]:
    """One row per `ROWS` entry and model: planned and measured memory, bytes and step
    time."""
    args = parse_args([f"--{k.replace('_', '-')}={v}" for k, v in options.items()])
    return [row for model in args.model.split(",")
            for row in _run_model(argparse.Namespace(**{**vars(args), "model": model}))]


def _run_model(args: argparse.Namespace) -> list[dict[str, Any]]:
    ranks = _ranks(args)
    larger = {n: _ranks(args, n) for n in sorted(set(WORLDS.values()))}
    # The slowest rank's numbers (the machine is shared), the latency's largest.
    machine = {k: min(r["machine"][k] for r in ranks) for k in ("gflops", "copy_gbps",
                                                                "busbw_gbps")}
    machine.update({k: max(r["machine"][k] for r in ranks) for k in ("op_s", "latency_s",
                                                                    "serial_step_s")})
    # The serial step's matmul FLOP/s: its counted FLOPs over its time less the operations'
    # host time and the memory traffic the planner prices apart (a description of this CPU
    # from a step that is not one of the rows).
    from trainer.plan.operations import rank_step

    work = rank_step(config(args, {"dp": 1}, world=1), bf16=False)
    rest = machine["serial_step_s"] - work.ops * machine["op_s"] - work.bytes / (
        1e9 * machine["copy_gbps"])
    serial_gflops = work.flops / max(rest, 1e-3 * machine["serial_step_s"]) / 1e9
    rows = []
    for name, over in ROWS.items():
        world = WORLDS.get(name, 2)
        sides = [r["rows"][name] for r in (larger[world] if name in WORLDS else ranks)]
        over = {**over, "overlap": sides[0]["overlap"]}  # planned as it ran
        plan = planned(args, over, machine, world)
        fitted = planned(args, over, {**machine, "gflops": serial_gflops}, world)
        step = statistics.median(max(s) for s in zip(*(x["steps"] for x in sides), strict=True))
        row: dict[str, Any] = {
            "layout": name, "ranks": world, "model": args.model, "seq_len": args.seq_len,
            "global_batch": args.global_batch, **machine,
            "mem_mib": max(x["memory"] for x in sides) / MIB,
            "mem_plan_mib": plan.memory.total / MIB,
            "serial_gflops": serial_gflops,
            "step_ms": 1e3 * step, "step_plan_ms": 1e3 * plan.step_s,
            "step_serial_plan_ms": 1e3 * fitted.step_s}
        for kind in KINDS:
            row[f"{kind}_mb"] = max(x["sent"][kind] for x in sides) / 1e6
            row[f"{kind}_plan_mb"] = getattr(plan.comm, kind) / 1e6
        # The first step against the plan of step 1 (a mixture of experts routes by the
        # initial router; the timed steps' routers have trained a step or more).
        at_first = planned(args, over, machine, world, steps=(1,))
        row["mem_first_mib"] = max(x["first"]["memory"] for x in sides) / MIB
        row["mem_first_plan_mib"] = at_first.memory.total / MIB
        row["ep_first_mb"] = max(x["first"]["sent"]["ep"] for x in sides) / 1e6
        row["ep_first_plan_mb"] = at_first.comm.ep / 1e6
        row["mem_err"] = row["mem_plan_mib"] / row["mem_mib"] - 1
        row["step_err"] = row["step_plan_ms"] / row["step_ms"] - 1
        row["step_serial_err"] = row["step_serial_plan_ms"] / row["step_ms"] - 1
        rows.append(row)
    return rows


COLUMNS = [("model", "model"), ("layout", "layout"), ("ranks", "ranks"), ("MiB", "mem_mib"),
           ("plan MiB", "mem_plan_mib"),
           *((f"{k} MB", f"{k}_mb") for k in KINDS),
           *((f"{k} plan", f"{k}_plan_mb") for k in KINDS),
           ("step ms", "step_ms"), ("plan ms", "step_plan_ms"), ("step err", "step_err"),
           ("plan ms, serial FLOP/s", "step_serial_plan_ms"),
           ("err, serial FLOP/s", "step_serial_err")]


SUMMARY_COLUMNS = COLUMNS
SUMMARY_NOTE = ("2 ranks (dp4 rows: 4), fp32, CPU over MPI. MiB: the largest rank's held "
                "tensors after a step, ZeRO-2/3's peaks during it and the peak saved for "
                "backward (as bench.memory), against the planner's. MB: "
                "bytes the busiest rank sends per step in each kind of group, counted on the "
                "trainer's communicators as the planner prices them (ring algorithms). plan ms: "
                "the planner's step time with this CPU as the cluster, every number measured "
                "by a microbenchmark (matmul FLOP/s at efficiency 1, copy bandwidth, host "
                "seconds per tensor operation, 2-rank all-reduce bandwidth and latency), none "
                "fitted to the steps; step err = plan / measured - 1. 'serial FLOP/s': the same "
                "with the matmul FLOP/s of the serial step (its counted FLOPs over its time "
                "less the priced host operations and memory traffic) instead of the matmul "
                "microbenchmark's.")


def print_table(rows: list[dict[str, Any]]) -> None:
    from bench.common import rich_table

    r0 = rows[0]
    rich_table(f"Planner vs trainer, 2 or 4 ranks, fp32 (seq {r0['seq_len']}, global batch "
               f"{r0['global_batch']}; CPU: matmul {r0['gflops']:.1f} GFLOP/s (serial "
               f"step {r0['serial_gflops']:.1f}), copy "
               f"{r0['copy_gbps']:.1f} GB/s, {1e6 * r0['op_s']:.1f} us per operation, "
               f"all-reduce {r0['busbw_gbps']:.2f} GB/s, {1e6 * r0['latency_s']:.1f} us per "
               "message step)", COLUMNS, rows, digits=3, width=220)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.plan_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny,small", help="GPT presets, comma-separated")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after 1 warmup step)")
    ap.add_argument("--timeout", type=float, default=900)
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
