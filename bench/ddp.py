"""Data-parallel step time: dtrain's Megatron-style DP against torch DDP (gloo), same everything.

    python -m bench.ddp [--ranks 2,4] [--shapes compute,comm] [--model small] [--seq-len 128]
                        [--global-batch 8] [--bucket-size 1000000] [--steps 16] [--json PATH]

Two shapes by default: ``compute`` (the GPT preset, 3.2M parameters for `small`, at --seq-len
and --global-batch: the step is nearly all compute on a CPU) and ``comm`` (25M parameters, d_model
512 x 8 layers, seq 32, global batch 4: 100 MB of gradients a step, as on a GPU, where compute is
fast and the reduction is what data parallelism adds). The sides run one after the other in one
invocation, each as N ranks under the MPICH wheel's ``mpiexec``, on the same model (GPT, seed 0),
the same global batch split the same way, the same AdamW and the same bucket size (DDP's
``bucket_cap_mb`` = our bucket size x 4 bytes):

* ``ours-hooks``  `trainer.parallel.data.grad_sync.DataParallel` over MPI, overlap on, each
                  bucket's nonblocking all-reduce posted and progressed from the gradient hooks;
* ``ours-thread`` overlap on, the all-reduces driven by a comm thread;
* ``ours-sync``   overlap off: every bucket reduced after backward with blocking all-reduces;
* ``torch-ddp``   ``torch.nn.parallel.DistributedDataParallel`` on a gloo process group
                  (``gradient_as_bucket_view=True``, ``broadcast_buffers=False``, like ours;
                  gradients set to None between steps, torch's default, so that DDP's reducer
                  copies each into its bucket with the 1/dp fused, as ours does, rather than
                  zeroing the buckets and dividing them after);
* ``no-comm``     the same step with no data parallelism at all (each rank its own model, no
                  gradient exchange, autograd's gradients kept as they come, never zeroed or
                  copied): the floor no DP can go below, so ``no-comm``'s ``vs DDP`` is the best
                  ratio any DP could reach on this model and host.

The side a training run uses on this host (`trainer.parallel.data.buckets.reduction_schedule`,
the default `trainer.training.run` and `DataParallel` take) is marked ``*``: its ``vs DDP`` is
dtrain's.

Per step the slowest rank's wall time counts (a step ends when the last rank ends); the table
shows medians over the timed steps, whose order rotates between the sides every round. ``cpu``
is the CPU time of a step (every thread of the process, the comm and gloo threads included;
median of the ranks' mean): on a shared, loaded host the wall time of every side stretches with
the load, the CPU time much less, so it shows what each side costs the machine.

Communication columns (ours only; DDP does its waiting inside ``backward()``):

* ``wait``: time a rank is blocked in ``finish_grad_sync`` (mean over ranks). It includes waiting
  for a slower peer to finish its backward, which is load imbalance, not communication.
* ``exposed``: from the moment the *last* rank finished backward to the moment the last rank
  has its reduced gradients. All ranks run on one host, so their monotonic clocks agree. This is
  the communication a perfectly balanced job would see after backward, with skew removed.
* ``comm alone``: every bucket all-reduced with nothing else running (same buckets and
  communicator).
* ``exposed / total``: exposed with overlap on, divided by exposed with overlap off (where all
  of the step's communication is exposed), i.e. the share of the in-step communication that
  overlap failed to hide.

Target (issue 40): dtrain's step <= 0.85x torch DDP's at dp 2 and 4.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from bench import common, rankjobs

SIDES = ("ours-hooks", "ours-thread", "ours-sync", "torch-ddp", "no-comm")
#: The shapes `--shapes` names: options over the preset (``compute``: none).
SHAPES: dict[str, dict[str, int]] = {
    "compute": {},
    "comm": {"d_model": 512, "n_layer": 8, "seq_len": 32, "global_batch": 4},
}
SUMMARY_NOTE = ("step_ms: median over the timed steps of the slowest rank's wall time, the sides "
                "interleaved; the side marked * (default) is the one a training run uses on "
                "this host; cpu_ms: CPU time per step of the process, comm and gloo threads "
                "included; vs_ddp, cpu_vs_ddp: against torch-ddp in the same run. no-comm is "
                "the step with no gradient exchange at all: its vs_ddp is the best any data "
                "parallelism could reach on this model and host. exposed_ms: from the last "
                "rank's end of backward to the last rank's reduced gradients (ours only; "
                "exposed_of_total: with overlap on / off). Shared, loaded 2-core machine: "
                "the load average is the one at the start.")
WARMUP = 2


def _build(args: argparse.Namespace, dp_rank: int, dp: int) -> tuple[Any, Any, Any]:
    """Model, optimizer and this rank's batches: identical recipe on every side."""
    from dataclasses import replace

    from trainer.data.batches import BatchPlan, ShardedBatches
    from trainer.data.corpus import load_corpus
    from trainer.model.config import PRESETS
    from trainer.model.gpt import GPT
    from trainer.optim.optimizer import build_optimizer

    cfg = replace(PRESETS[args.model], seq_len=args.seq_len)
    if args.d_model:  # heads of 64 channels, as in GPT-2
        cfg = replace(cfg, d_model=args.d_model, n_head=max(1, args.d_model // 64))
    if args.n_layer:
        cfg = replace(cfg, n_layer=args.n_layer)
    model = GPT(cfg, seed=0)
    optimizer = build_optimizer(model, lr=1e-4, weight_decay=0.1)
    plan = BatchPlan(args.global_batch, dp, args.microbatches)
    batches = ShardedBatches(load_corpus(cap_bytes=1 << 20), seq_len=cfg.seq_len, plan=plan,
                             seed=0, dp_rank=dp_rank)
    return model, optimizer, batches


class OursSide:
    """dtrain's DataParallel over the MPI world communicator."""

    def __init__(self, args: argparse.Namespace, world: Any, *, overlap: bool,
                 comm_thread: bool | None = None) -> None:
        from trainer.parallel.data.grad_sync import DataParallel

        self.model, self.optimizer, self.batches = _build(args, world.rank, world.size)
        self.dp = DataParallel(self.model, world.comm, bucket_size=args.bucket_size,
                               overlap=overlap, comm_thread=comm_thread)

    def step(self, i: int) -> dict[str, float]:
        """One training step; the wait and the (host-wide monotonic) end of backward and sync."""
        self.dp.zero_grad()
        _micro_loop(self.model.loss, self.batches, i, self.dp.no_sync)
        backward_end = time.perf_counter()
        self.dp.finish_grad_sync()
        sync_end = time.perf_counter()
        self.optimizer.step()
        return {"wait_s": sync_end - backward_end, "backward_end": backward_end,
                "sync_end": sync_end}

    def comm_alone(self) -> float:
        """Every bucket all-reduced with nothing else running (the total overlap can hide)."""
        self.dp.comm.barrier()
        start = time.perf_counter()
        for bucket in self.dp.buckets:
            self.dp.comm.all_reduce(bucket.view)
        return time.perf_counter() - start


class DdpSide:
    """torch.nn.parallel.DistributedDataParallel on a gloo process group."""

    def __init__(self, args: argparse.Namespace, world: Any) -> None:
        import torch.nn.functional as F
        from torch.nn.parallel import DistributedDataParallel

        self.model, self.optimizer, self.batches = _build(args, world.rank, world.size)
        self.ddp = DistributedDataParallel(self.model, bucket_cap_mb=args.bucket_size * 4 / 2**20,
                                           broadcast_buffers=False, gradient_as_bucket_view=True)
        # The loss must run through DDP's forward, which arms its reducer for the backward.
        self.loss = lambda x, y: F.cross_entropy(self.ddp(x).flatten(0, 1), y.flatten())

    def step(self, i: int) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        _micro_loop(self.loss, self.batches, i, self.ddp.no_sync)
        self.optimizer.step()
        return {}


class NoCommSide:
    """The step without data parallelism: what every side computes, nothing exchanged."""

    def __init__(self, args: argparse.Namespace, world: Any) -> None:
        self.model, self.optimizer, self.batches = _build(args, world.rank, world.size)

    def step(self, i: int) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        _micro_loop(self.model.loss, self.batches, i, contextlib.nullcontext)
        self.optimizer.step()
        return {}


def _micro_loop(loss: Callable[[Any, Any], Any], batches: Any, i: int,
                no_sync: Callable[[], Any]) -> None:
    micro = batches.microbatches(i)
    for k, (x, y) in enumerate(micro):
        if k < len(micro) - 1:
            with no_sync():
                (loss(x, y) / len(micro)).backward()
        else:
            (loss(x, y) / len(micro)).backward()


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """All three sides in the same processes, their steps interleaved (the order rotating each
    round), so machine noise hits every side alike."""
    import torch.distributed as dist

    from trainer.comm.bootstrap import init

    world = init(backend="mpi")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}",
                            rank=world.rank, world_size=world.size)
    sides = {"ours-hooks": OursSide(args, world, overlap=True, comm_thread=False),
             "ours-thread": OursSide(args, world, overlap=True, comm_thread=True),
             "ours-sync": OursSide(args, world, overlap=False), "torch-ddp": DdpSide(args, world),
             "no-comm": NoCommSide(args, world)}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in SIDES}
    for i in range(1, WARMUP + args.steps + 1):
        order = SIDES[i % len(SIDES):] + SIDES[:i % len(SIDES)]
        for name in order:
            world.comm.barrier()  # every rank starts the step together
            start, cpu = time.perf_counter(), time.process_time()
            times = sides[name].step(i)
            if i > WARMUP:
                rows[name].append({"step_s": time.perf_counter() - start,
                                   "cpu_s": time.process_time() - cpu, **times})
    sync = cast(OursSide, sides["ours-sync"])
    alone = statistics.median(sync.comm_alone() for _ in range(args.steps))
    dist.destroy_process_group()
    return {"rank": world.rank, "sides": rows, "comm_alone_s": alone,
            "buckets": len(sync.dp.buckets), "params": sync.model.num_params(),
            "default": default_side(world.comm.backend)}


def default_side(backend: str) -> str:
    """The side a training run uses on this host: the default reduction schedule's."""
    from trainer.parallel.data.buckets import reduction_schedule

    return f"ours-{reduction_schedule(backend)}"


def _ranks(ranks: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    from testbed.mpiexec import clean_env
    from testbed.sshd import free_port

    passed = ("model", "seq_len", "global_batch", "microbatches", "bucket_size", "steps",
              "d_model", "n_layer")
    return rankjobs.rank_results("bench.ddp", ranks, args, passed,
                                 env=clean_env({"BENCH_PORT": str(free_port())}))


def summarize(side: str, ranks: int, per_rank: list[dict[str, Any]],
              shape: str) -> dict[str, Any]:
    """Medians over the timed steps of the slowest rank's step time, the mean wait and the
    skew-free exposed time."""
    steps = list(zip(*(r["sides"][side] for r in per_rank), strict=True))  # [step][rank]
    row = {"shape": shape, "side": side, "default": side == per_rank[0]["default"],
           "ranks": ranks, "buckets": per_rank[0]["buckets"], "params": per_rank[0]["params"],
           "step_ms": 1e3 * statistics.median(max(r["step_s"] for r in s) for s in steps),
           "cpu_ms": 1e3 * statistics.median(
               statistics.mean(r["cpu_s"] for r in s) for s in steps)}
    if side.startswith("ours"):
        row["wait_ms"] = 1e3 * statistics.median(
            statistics.mean(r["wait_s"] for r in s) for s in steps)
        row["exposed_ms"] = 1e3 * statistics.median(
            max(r["sync_end"] for r in s) - max(r["backward_end"] for r in s) for s in steps)
        row["comm_alone_ms"] = 1e3 * statistics.mean(r["comm_alone_s"] for r in per_rank)
    return row


def run(ranks: Sequence[int] = (2, 4), shapes: Sequence[str] = tuple(SHAPES),
        **options: Any) -> list[dict[str, Any]]:
    """Every side at every rank count of every shape; one row per (shape, ranks, side), plus
    derived ratios."""
    rows = []
    for shape in shapes:
        args = parse_args(rankjobs.as_argv({**options, **SHAPES[shape]}))
        for n in ranks:
            per_rank = _ranks(n, args)
            hooks, thread, sync, ddp, floor = (summarize(side, n, per_rank, shape)
                                               for side in SIDES)
            for row in (hooks, thread, sync, floor):
                row["vs_ddp"] = row["step_ms"] / ddp["step_ms"]
                row["cpu_vs_ddp"] = row["cpu_ms"] / ddp["cpu_ms"]
            for row in (hooks, thread):
                row["exposed_of_total"] = row["exposed_ms"] / max(sync["exposed_ms"], 1e-9)
            rows += [hooks, thread, sync, ddp, floor]
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="DP step time on CPU: dtrain DataParallel (MPI) vs torch DDP (gloo); "
                  "* the side a training run uses here")
    for col in ("shape", "params", "ranks", "side", "step ms", "vs DDP", "cpu ms", "cpu vs DDP",
                "wait ms", "exposed ms", "comm alone ms", "exposed / total", "buckets"):
        table.add_column(col, justify="right")
    for r in rows:
        ours = r["side"].startswith("ours")
        table.add_row(r["shape"], f"{r['params'] / 1e6:.1f}M", str(r["ranks"]),
                      r["side"] + ("*" if r["default"] else ""), f"{r['step_ms']:.1f}",
                      f"{r['vs_ddp']:.2f}x" if "vs_ddp" in r else "", f"{r['cpu_ms']:.1f}",
                      f"{r['cpu_vs_ddp']:.2f}x" if "cpu_vs_ddp" in r else "",
                      f"{r['wait_ms']:.2f}" if ours else "",
                      f"{r['exposed_ms']:.2f}" if ours else "",
                      f"{r['comm_alone_ms']:.2f}" if ours else "",
                      f"{r['exposed_of_total']:.0%}" if "exposed_of_total" in r else "",
                      str(r["buckets"]) if ours else "")
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.ddp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4", help="DP sizes, e.g. 2,4")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"model shapes, of {', '.join(SHAPES)} (see above)")
    ap.add_argument("--model", default="small", help="GPT preset")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=0, help="override the preset's width")
    ap.add_argument("--n-layer", type=int, default=0, help="override the preset's depth")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--bucket-size", type=int, default=1_000_000, help="elements per bucket")
    ap.add_argument("--steps", type=int, default=16,
                    help="timed steps (after 2 warmup steps); 16 steady the medians on a busy host")
    rankjobs.add_worker_options(ap, timeout=300)
    return ap.parse_args(argv)



def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return common.save_rank_result(args.out, worker(args))
    rows = run([int(n) for n in args.ranks.split(",")], args.shapes.split(","),
               **rankjobs.options(args, drop=("ranks", "shapes")))
    return common.report(rows, print_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
