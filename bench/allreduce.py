"""CPU all-reduce bus bandwidth: dtrain's MpiCommunicator against torch.distributed's gloo.

    python -m bench.allreduce [--ranks 2,4] [--sizes 1K,16K,256K,1M,4M,16M,64M] [--json PATH]

Both sides run in the same invocation, one after the other, as N processes started by the MPICH
wheel's ``mpiexec``: the MPI side through ``trainer.comm.bootstrap.init(backend="mpi")``, the gloo
side as plain processes (no mpi4py) that read their rank from Hydra's PMI_RANK and meet over a TCP
store. Both are timed by the same function (`trainer.comm.bandwidth.measure_allreduce`, fp32 SUM,
slowest rank, nccl-tests' bus-bandwidth formula), so the ratio compares transports, not harnesses.
``run()`` returns one dict per (ranks, size) with both bandwidths and mpi/gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SIZES = "1K,16K,256K,1M,4M,16M,64M"


def iters_for(nbytes: int) -> int:
    """Enough repetitions for a stable time, bounded so 64 MB on 4 ranks stays a few seconds."""
    return max(3, min(100, (64 << 20) // nbytes))


class GlooComm:
    """Just enough of the Communicator protocol over torch.distributed for the timing function."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.size = dist.get_world_size()
        self.rank = dist.get_rank()

    def all_reduce(self, t: Any, op: Any = None) -> None:
        from trainer.comm.protocol import ReduceOp

        ops = {None: "SUM", ReduceOp.SUM: "SUM", ReduceOp.MAX: "MAX", ReduceOp.MIN: "MIN"}
        self._dist.all_reduce(t, op=getattr(self._dist.ReduceOp, ops[op]))

    def barrier(self) -> None:
        self._dist.barrier()


def worker(transport: str, sizes: Sequence[int], out: Path) -> None:
    """One rank of one side; rank 0 writes the samples to ``out``."""
    import torch

    from trainer.comm.bandwidth import measure_allreduce

    if transport == "mpi":
        from trainer.comm.bootstrap import init

        comm: Any = init(backend="mpi").comm
    else:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}",
            rank=int(os.environ["PMI_RANK"]), world_size=int(os.environ["PMI_SIZE"]))
        comm = GlooComm()
    cpu = torch.device("cpu")
    samples = [measure_allreduce(comm, n, device=cpu, iters=iters_for(n)) for n in sizes]
    if comm.rank == 0:
        out.write_text(json.dumps([s.__dict__ for s in samples]))
    comm.barrier()
    if transport == "gloo":
        comm._dist.destroy_process_group()



def _side(ranks: int, transport: str, sizes: str, timeout: float) -> list[dict[str, Any]]:
    sys.path.insert(0, str(REPO))
    from testbed.mpiexec import clean_env, run_mpiexec
    from testbed.sshd import free_port

    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
        out = Path(tmp, "samples.json")
        env = clean_env({"BENCH_PORT": str(free_port())})
        proc = run_mpiexec(ranks, [sys.executable, "-m", "bench.allreduce", "--worker", transport,
                                   "--sizes", sizes, "--out", str(out)], timeout=timeout, env=env)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{transport} side failed on {ranks} ranks:\n{proc.stdout[-3000:]}")
        return json.loads(out.read_text())


def run(ranks: Sequence[int] = (2, 4), sizes: str = DEFAULT_SIZES,
        timeout: float = 300) -> list[dict[str, Any]]:
    """Measure both sides for every rank count; one row per (ranks, size)."""
    rows = []
    for n in ranks:
        mpi = _side(n, "mpi", sizes, timeout)
        gloo = _side(n, "gloo", sizes, timeout)
        for m, g in zip(mpi, gloo, strict=True):
            rows.append({
                "ranks": n, "bytes": m["nbytes"],
                "mpi_us": m["seconds"] * 1e6, "gloo_us": g["seconds"] * 1e6,
                "mpi_busbw_gbps": m["busbw_gbps"], "gloo_busbw_gbps": g["busbw_gbps"],
                "ratio": g["seconds"] / m["seconds"] if m["seconds"] > 0 else float("nan"),
            })
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    from trainer.comm.bandwidth import format_size

    table = Table(title="CPU all-reduce fp32 SUM: dtrain MPI vs torch gloo (bus bandwidth)")
    for col in ("ranks", "size", "MPI us", "gloo us", "MPI busbw GB/s", "gloo busbw GB/s",
                "MPI/gloo"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["ranks"]), format_size(r["bytes"]), f"{r['mpi_us']:.1f}",
                      f"{r['gloo_us']:.1f}", f"{r['mpi_busbw_gbps']:.3f}",
                      f"{r['gloo_busbw_gbps']:.3f}", f"{r['ratio']:.2f}x")
    Console(width=None if sys.stdout.isatty() else 120).print(table)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.allreduce", description=__doc__)
    ap.add_argument("--ranks", default="2,4", help="rank counts, e.g. 2,4")
    ap.add_argument("--sizes", default=DEFAULT_SIZES)
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--worker", choices=["mpi", "gloo"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from bench import common
    from trainer.comm.bandwidth import parse_sizes

    if args.worker:
        worker(args.worker, parse_sizes(args.sizes), Path(args.out))
        return 0
    rows = run([int(n) for n in args.ranks.split(",")], args.sizes)
    return common.report(rows, print_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
