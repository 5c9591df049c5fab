"""Sharded embeddings on CPU: lookups per second, all-to-all bytes against the analytic count,
the step split and each rank's table memory, at G = 1, 2, 4 for one big table.

    python -m bench.sparse [--rows 10000000] [--dim 64] [--features 8] [--batch 512]
                           [--steps 5] [--json PATH]

One DLRM step (`trainer.recsys`: 8 one-hot features, bottom/top MLPs of 256, SGD) per
iteration with the table of ``--rows`` x ``--dim`` fp32 rows sharded over G ranks under the
MPICH wheel's ``mpiexec`` (no rank holds more than its ceil(rows/G) rows). Weak scaling: every
rank looks up ``--batch`` x ``--features`` uniformly random keys per step, so the job's lookups
per second should grow with G where cores allow. The world communicator is wrapped in
`CountingCommunicator`, which counts the payload handed to every ``all_to_all`` (each rank's own
block included).

Analytic payload per rank and step, K = batch x features keys, D dims, fp32: the count
exchange 8G bytes, the keys 8K, the rows back 4DK (in expectation: a rank returns as many rows
as it received keys, K on average over ranks), the gradients 4DK: 8G + 8K + 8DK. Of the keys,
rows and gradients a fraction (G-1)/G leaves the rank (``off-rank MB``, measured from the
exchange plans).

Step split (host clock of rank 0, median): ``dispatch`` (routing, counts, keys to owners, rows
back, order restored), ``lookup`` (local gather), ``backward`` (gradients to owners, duplicate
sums), ``dense`` (the rest of the step: interaction, MLPs, DP all-reduce, both optimizers).
Memory: the table shard's bytes on the largest rank against 1/G of the whole, and the peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from typing import Any

from bench import rankjobs

WARMUP = 1
SUMMARY_COLUMNS = [("G", "ranks"), ("table rows", "rows"), ("dim", "dim"),
                   ("lookups/s", "lookups_per_s"), ("step ms", "step_ms"),
                   ("dispatch ms", "dispatch_ms"), ("lookup ms", "lookup_ms"),
                   ("dense ms", "dense_ms"), ("backward ms", "backward_ms"),
                   ("a2a MB meas", "a2a_mb"), ("a2a MB calc", "a2a_mb_calc"),
                   ("off-rank MB meas", "off_mb"), ("off-rank MB calc", "off_mb_calc"),
                   ("shard MB", "shard_mb"), ("1/G MB", "share_mb"), ("peak RSS MB", "rss_mb")]
SUMMARY_NOTE = ("Per rank and step; weak scaling (each rank looks up the same number of keys). "
                "a2a MB is the payload of every all_to_all (own block included), analytic "
                "8G + 8K + 8DK bytes for K keys; off-rank MB the part that leaves the rank, "
                "analytic (G-1)/G of keys, rows and gradients. Times are CPU over MPI on a "
                "shared machine, not a GPU forecast.")


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from trainer.comm.bootstrap import init
    from trainer.parallel.data.grad_sync import DataParallel
    from trainer.parallel.tensor.counting import CountingCommunicator
    from trainer.recsys.data import DENSE, Batches, ClickLog
    from trainer.recsys.model import DLRM, DLRMConfig
    from trainer.sparse import SparseOptimizer

    world = init(backend="mpi")
    counted = CountingCommunicator(world.comm)
    vocab = (args.rows // args.features,) * args.features
    cfg = DLRMConfig(vocab=vocab, dim=args.dim, bottom=(256,), top=(256,))
    model = DLRM(cfg, counted, seed=0)
    dp = DataParallel(model.dense, world.comm)
    dense_opt = torch.optim.SGD(model.dense.parameters(), lr=0.01)
    sparse_opt = SparseOptimizer([model.table], kind="sgd", lr=0.01)
    n = args.batch * world.size * (WARMUP + args.steps)
    gen = torch.Generator().manual_seed(1)
    log = ClickLog(torch.randn(n, DENSE, generator=gen),
                   torch.stack([torch.randint(0, v, (n,), generator=gen) for v in vocab], 1),
                   torch.randint(0, 2, (n,), generator=gen).float(), vocab, "uniform keys")
    batches = Batches(log, args.batch * world.size, 1, world.rank, world.size)
    steps = []
    for step in range(1, WARMUP + args.steps + 1):
        counted.reset()
        world.comm.barrier()
        start = time.perf_counter()
        dp.zero_grad()
        sparse_opt.zero_grad()
        b = batches.at(step)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model.logits(b.dense, b.sparse), b.labels)
        loss.backward()
        dp.finish_grad_sync()
        dense_opt.step()
        sparse_opt.step()
        step_s = time.perf_counter() - start
        phases = model.table.take_timings()
        plan, row = model.table.last, args.dim * 4
        off = plan.send_bytes(8 + row) + row * (plan.received - plan.recv_splits[world.rank])
        if step > WARMUP:
            steps.append({"step_s": step_s, **phases, "a2a_bytes":
                          counted.total("all_to_all").bytes, "off_bytes": off})
    shard = model.table.weight.numel() * model.table.weight.element_size()
    return {"rank": world.rank, "steps": steps, "shard_bytes": shard,
            "rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def summarize(per_rank: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    g, med = len(per_rank), statistics.median
    r0 = per_rank[0]["steps"]
    slowest = [max(r["steps"][i]["step_s"] for r in per_rank) for i in range(len(r0))]
    keys = args.batch * args.features
    row = {"ranks": g, "rows": args.rows, "dim": args.dim, "step_ms": 1e3 * med(slowest),
           "lookups_per_s": g * keys / med(slowest)}
    phases = {"dispatch": ("dispatch", "return"), "lookup": ("lookup",),
              "backward": ("backward",)}
    for name, parts in phases.items():
        row[f"{name}_ms"] = 1e3 * med(sum(s[p] for p in parts) for s in r0)
    row["dense_ms"] = 1e3 * med(s["step_s"] for s in r0) - sum(
        row[f"{p}_ms"] for p in phases)
    row["a2a_mb"] = med(s["a2a_bytes"] for s in r0) / 1e6
    row["a2a_mb_calc"] = (8 * g + 8 * keys + 8 * args.dim * keys) / 1e6
    row["off_mb"] = med(s["off_bytes"] for s in r0) / 1e6
    row["off_mb_calc"] = (g - 1) / g * (8 * keys + 8 * args.dim * keys) / 1e6
    row["shard_mb"] = max(r["shard_bytes"] for r in per_rank) / 1e6
    row["share_mb"] = args.rows * args.dim * 4 / g / 1e6
    row["rss_mb"] = max(r["rss_kb"] for r in per_rank) / 1e3
    return row


def _ranks(n: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    return rankjobs.rank_results("bench.sparse", n, args,
                                 ("rows", "dim", "features", "batch", "steps"))


def run(**options: Any) -> list[dict[str, Any]]:
    """One row per G in ``--worlds``."""
    args = parse_args(rankjobs.as_argv(options, drop=("worlds",)))
    worlds = options.get("worlds", (1, 2, 4))
    return [summarize(_ranks(g, args), args) for g in worlds]


def print_table(rows: list[dict[str, Any]]) -> None:
    from bench import common

    r0 = rows[0]
    common.print_rows(f"Sharded embedding, {r0['rows']:,} x {r0['dim']} fp32 table, DLRM step",
                      rows, SUMMARY_COLUMNS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.sparse", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000, help="table rows in all")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--features", type=int, default=8)
    ap.add_argument("--batch", type=int, default=512, help="click-log rows per rank and step")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after 1 warmup step)")
    rankjobs.add_worker_options(ap, timeout=900)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return rankjobs.main(parse_args(argv), worker, run, print_table)


if __name__ == "__main__":
    sys.exit(main())
