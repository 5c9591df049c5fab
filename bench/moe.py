"""Mixture of experts: all-to-all bytes vs analytic, step time at ep 1/2/4, all-to-all bandwidth.

    python -m bench.moe [--ranks 2,4] [--sizes 1M,4M,16M] [--steps 5] [--json PATH]

Three tables from one invocation, every side started by the MPICH wheel's ``mpiexec``:

* ``a2a``: the variable all-to-all (``MpiCommunicator.all_to_all`` with split sizes,
  ``Alltoallv``) against torch.distributed gloo's ``all_to_all_single`` with the same uneven
  splits (rank r sends (1 + (r + j) mod n) shares of its message to rank j), on 2 and 4 ranks.
  Both timed alike (slowest rank, mean of the iterations); bus bandwidth as nccl-tests'
  alltoall: algbw * (n-1)/n, algbw = bytes each rank sends / time.
* ``bytes``: the rows one training step of an E = 8, top-2 MoE model moves through the EP
  all-to-alls (mean over ranks) at ep 4 on 4 ranks, counted on the communicator, against
  the analytic count
  tokens x k x d_model x 4 bytes x 2 directions (dispatch, combine) x 2 passes (forward,
  backward), dropless. Rows a rank keeps for its own experts go through the call too; the
  share that leaves the rank is reported beside it.
* ``step``: median step time of the same model at ep 1, 2 and 4 on 4 ranks (dp 4).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SIZES = "1M,4M,16M"
MODEL = {"n_layer": 2, "n_head": 4, "d_model": 128, "seq_len": 128, "moe_experts": 8,
         "moe_topk": 2}
BATCH = 16


def _weights(rank: int, n: int) -> list[int]:
    return [1 + (rank + j) % n for j in range(n)]


def uneven_splits(rank: int, n: int, rows: int) -> tuple[list[int], list[int]]:
    """(rows this rank sends to each peer, rows it receives from each), ``rows`` sent in all."""
    def split(r: int) -> list[int]:
        w = _weights(r, n)
        parts = [rows * x // sum(w) for x in w]
        parts[0] += rows - sum(parts)
        return parts
    return split(rank), [split(j)[rank] for j in range(n)]


def a2a_worker(transport: str, sizes: Sequence[int], out: Path) -> None:
    import torch

    from trainer.comm.protocol import ReduceOp

    if transport == "mpi":
        from trainer.comm.bootstrap import init

        comm = init(backend="mpi").comm
        rank, n = comm.rank, comm.size

        def exchange(o: Any, i: Any, ins: list[int], outs: list[int]) -> None:
            comm.all_to_all(o, i, in_splits=ins, out_splits=outs)

        def slowest(t: Any) -> None:
            comm.all_reduce(t, ReduceOp.MAX)
    else:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}",
            rank=int(os.environ["PMI_RANK"]), world_size=int(os.environ["PMI_SIZE"]))
        rank, n = dist.get_rank(), dist.get_world_size()

        def exchange(o: Any, i: Any, ins: list[int], outs: list[int]) -> None:
            dist.all_to_all_single(o, i, output_split_sizes=outs, input_split_sizes=ins)

        def slowest(t: Any) -> None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
    rows = []
    for nbytes in sizes:
        count = nbytes // 4
        ins, outs = uneven_splits(rank, n, count)
        inp, res = torch.ones(count), torch.empty(sum(outs))
        iters = max(3, min(50, (64 << 20) // nbytes))
        for _ in range(2):
            exchange(res, inp, ins, outs)
        start = time.perf_counter()
        for _ in range(iters):
            exchange(res, inp, ins, outs)
        elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
        slowest(elapsed)
        seconds = float(elapsed)
        rows.append({"bytes": count * 4, "seconds": seconds,
                     "busbw_gbps": count * 4 / seconds / 1e9 * (n - 1) / n})
    if rank == 0:
        out.write_text(json.dumps(rows))
    if transport == "gloo":
        dist.destroy_process_group()


def train_worker(ep_sizes: Sequence[int], steps: int, out: Path) -> None:
    """Step times at every ep, and the all-to-all rows of one step at the largest ep."""
    import torch

    from trainer.comm.bootstrap import init
    from trainer.config.options import make_config, resolve_dp
    from trainer.parallel.expert.layer import moe_layers
    from trainer.training.run import build_run, mesh_for
    from trainer.training.step import train_step

    torch.set_num_threads(1)
    world = init(backend="mpi")
    result: dict[str, Any] = {"step_s": {}}
    run_dir = str(out.parent)  # `_launch`'s temporary directory, removed with what runs leave
    for ep in ep_sizes:
        cfg = resolve_dp(make_config(
            {"model": "tiny", "global_batch": BATCH, "steps": steps, "ep": ep, "eval_every": 0,
             "data_cap_mb": 0.5, "run_dir": run_dir}, MODEL), world.size)
        run = build_run(cfg, mesh_for(cfg, world))
        counted = _count_rows(moe_layers(run.model)) if ep == max(ep_sizes) else None
        times = [train_step(run, step).step_s for step in range(1, steps + 1)]
        result["step_s"][ep] = statistics.median(times[1:] or times)
        if counted is not None:  # a rank's combine sends what its experts got: average ranks
            both = torch.tensor([counted["rows"], counted["local"]], dtype=torch.float64)
            world.comm.all_reduce(both)
            result["rows"], result["local_rows"] = (both / (steps * world.size)).tolist()
    if world.rank == 0:
        out.write_text(json.dumps(result))


def _count_rows(layers: list) -> dict[str, int]:
    """Wrap each layer's EP group so it counts the rows of its variable all-to-alls."""
    counted = {"rows": 0, "local": 0}
    for comm in {id(layer.ep): layer.ep for _, layer in layers}.values():  # shared by layers
        original = comm.all_to_all

        def counting(out: Any, inp: Any, *, in_splits: Any = None, out_splits: Any = None,
                     async_op: bool = False, _orig: Any = original, _comm: Any = comm) -> Any:
            if in_splits is not None:
                counted["rows"] += sum(in_splits)
                counted["local"] += in_splits[_comm.rank]
            return _orig(out, inp, in_splits=in_splits, out_splits=out_splits, async_op=async_op)
        comm.all_to_all = counting
    return counted


def _launch(ranks: int, args: list[str], timeout: float) -> Any:
    sys.path.insert(0, str(REPO))
    from bench.allreduce import _free_port
    from testbed.mpiexec import clean_env, run_mpiexec

    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
        out = Path(tmp, "out.json")
        env = clean_env({"BENCH_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"})
        proc = run_mpiexec(ranks, [sys.executable, "-m", "bench.moe", *args, "--out", str(out)],
                           timeout=timeout, env=env)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"bench.moe {args} failed on {ranks} ranks:\n{proc.stdout[-3000:]}")
        return json.loads(out.read_text())


def run(ranks: Sequence[int] = (2, 4), sizes: str = DEFAULT_SIZES, steps: int = 5,
        eps: Sequence[int] = (1, 2, 4), timeout: float = 600) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n in ranks:
        mpi = _launch(n, ["--worker", "mpi", "--sizes", sizes], timeout)
        gloo = _launch(n, ["--worker", "gloo", "--sizes", sizes], timeout)
        for m, g in zip(mpi, gloo, strict=True):
            rows.append({"table": "a2a", "ranks": n, "bytes": m["bytes"],
                         "mpi_busbw_gbps": m["busbw_gbps"], "gloo_busbw_gbps": g["busbw_gbps"],
                         "ratio": g["seconds"] / m["seconds"]})
    world = max(eps)
    trained = _launch(world, ["--worker", "train", "--eps", ",".join(map(str, eps)),
                              "--steps", str(steps)], timeout)
    tokens_per_rank = BATCH // world * MODEL["seq_len"]
    moe_layers = len(range(0, MODEL["n_layer"], MODEL.get("moe_every", 1)))
    analytic = tokens_per_rank * MODEL["moe_topk"] * 2 * 2 * moe_layers
    rows.append({"table": "bytes", "ep": world, "measured_bytes": round(trained["rows"] *
                 MODEL["d_model"] * 4), "analytic_bytes": analytic * MODEL["d_model"] * 4,
                 "off_rank_share": 1 - trained["local_rows"] / max(1, trained["rows"])})
    base = trained["step_s"][str(eps[0])]
    for ep in eps:
        rows.append({"table": "step", "ep": ep, "ranks": world,
                     "step_ms": trained["step_s"][str(ep)] * 1e3,
                     "vs_ep1": trained["step_s"][str(ep)] / base})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    from trainer.comm.bandwidth import format_size

    console = Console(width=None if sys.stdout.isatty() else 120)
    a2a = Table(title="Variable all-to-all, uneven splits: dtrain MPI vs torch gloo (bus bw)")
    for col in ("ranks", "size", "MPI GB/s", "gloo GB/s", "MPI/gloo"):
        a2a.add_column(col, justify="right")
    for r in (r for r in rows if r["table"] == "a2a"):
        a2a.add_row(str(r["ranks"]), format_size(r["bytes"]), f"{r['mpi_busbw_gbps']:.3f}",
                    f"{r['gloo_busbw_gbps']:.3f}", f"{r['ratio']:.2f}x")
    console.print(a2a)
    other = Table(title=f"MoE E={MODEL['moe_experts']} top-{MODEL['moe_topk']}, d_model "
                        f"{MODEL['d_model']}: all-to-all bytes per step and rank, step time")
    for col in ("what", "ep", "measured", "analytic / ep 1", "note"):
        other.add_column(col, justify="right")
    for r in rows:
        if r["table"] == "bytes":
            other.add_row("a2a bytes", str(r["ep"]), f"{r['measured_bytes']:,}",
                          f"{r['analytic_bytes']:,}", f"{r['off_rank_share']:.0%} leave the rank")
        elif r["table"] == "step":
            other.add_row("step ms", str(r["ep"]), f"{r['step_ms']:.1f}", f"{r['vs_ep1']:.2f}x",
                          f"{r['ranks']} ranks")
    console.print(other)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__)
    ap.add_argument("--ranks", default="2,4", help="rank counts of the all-to-all table")
    ap.add_argument("--sizes", default=DEFAULT_SIZES)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--eps", default="1,2,4", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--worker", choices=["mpi", "gloo", "train"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from bench import common
    from trainer.comm.bandwidth import parse_sizes

    eps = [int(e) for e in args.eps.split(",")]
    if args.worker == "train":
        train_worker(eps, args.steps, Path(args.out))
        return 0
    if args.worker:
        a2a_worker(args.worker, parse_sizes(args.sizes), Path(args.out))
        return 0
    rows = run([int(n) for n in args.ranks.split(",")], args.sizes, args.steps, eps)
    return common.report(rows, print_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
