"""``python -m trainer.diagnose``: is this job's communication sound, and how fast is it?

Run it exactly like a training job (``dtrain launch ... -- python -m trainer.diagnose`` or
``mpiexec -n 4 python -m trainer.diagnose``). Every rank prints one line (host, rank, device, MPI
library, world size, NCCL version and whether the NCCL unique id reached every rank intact, or
"cpu: MPI backend"); rank 0 then prints a table of all ranks and the all-reduce bus bandwidth on
the world and on each sub-communicator of a small grid (tp=2 when the world size is even).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from trainer.comm import bootstrap
from trainer.comm.bandwidth import Sample, format_size, measure_allreduce, parse_sizes
from trainer.comm.mesh import Mesh
from trainer.comm.protocol import Communicator
from trainer.comm.topology import MeshShape
from trainer.errors import TrainerError


def rank_info(world: bootstrap.World) -> dict[str, Any]:
    """What this rank knows about itself; the unique-id check is collective on GPU."""
    mpi = sys.modules["mpi4py.MPI"]
    return {
        "host": os.environ.get("DTRAIN_HOST") or socket.gethostname(),
        "rank": world.rank,
        "local_rank": world.local_rank,
        "device": str(world.device),
        "mpi": mpi.Get_library_version().splitlines()[0].strip(),
        "world_size": world.size,
        "nccl": _nccl_version(),
        "unique_id": _unique_id_check(world),
    }


def _nccl_version() -> str:
    from trainer.comm.nccl.setup import nccl_version

    try:
        return nccl_version()
    except TrainerError:
        return "nccl4py not installed"
    except Exception as exc:  # noqa: BLE001 - libnccl not loadable here: report, do not fail
        return f"unavailable ({type(exc).__name__}: {exc})"


def _unique_id_check(world: bootstrap.World) -> str:
    if world.comm.backend != "nccl":
        return "cpu: MPI backend"
    from trainer.comm.nccl.setup import share_unique_id

    digest = hashlib.sha1(bytes(share_unique_id(world.mpi_comm).as_bytes)).hexdigest()[:12]
    digests = set(world.mpi_comm.allgather(digest))
    return f"ok: id {digest} on all {world.size} ranks" if len(digests) == 1 else \
        f"MISMATCH: {len(digests)} different ids"


def communicators(world: bootstrap.World) -> list[tuple[str, Communicator]]:
    """The world plus the axes of a (dp, tp=2, pp=1) grid when the world size is even."""
    out: list[tuple[str, Communicator]] = [("world", world.comm)]
    if world.size >= 2 and world.size % 2 == 0:
        mesh = Mesh.build(world.comm, MeshShape(dp=world.size // 2, tp=2), world.device)
        out += [(f"grid_{axis}", mesh.group(axis)) for axis in ("tp", "dp", "pp")]
    return out


def bandwidth(world: bootstrap.World, sizes: Sequence[int], iters: int) -> list[dict[str, Any]]:
    """Every rank measures on its own group; rank 0 gets the slowest group per axis and size."""
    rows = []
    for label, comm in communicators(world):
        for nbytes in sizes:
            sample = measure_allreduce(comm, nbytes, device=world.device, iters=iters)
            samples: list[Sample] | None = world.mpi_comm.gather(sample, root=0)
            if samples is not None:
                slowest = max(samples, key=lambda s: s.seconds)
                rows.append({"comm": label, "ranks": slowest.ranks, "bytes": nbytes,
                             "us": slowest.seconds * 1e6, "algbw": slowest.algbw_gbps,
                             "busbw": slowest.busbw_gbps})
    return rows


def print_report(infos: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    console = Console(width=None if sys.stdout.isatty() else 160)
    ranks = Table(title="dtrain diagnose: ranks")
    for col in ("rank", "host", "local", "device", "MPI library", "world", "NCCL", "unique id"):
        ranks.add_column(col, overflow="fold")
    for i in sorted(infos, key=lambda i: i["rank"]):
        ranks.add_row(str(i["rank"]), i["host"], str(i["local_rank"]), i["device"], i["mpi"],
                      str(i["world_size"]), i["nccl"], i["unique_id"])
    console.print(ranks)
    bw = Table(title="all-reduce fp32 SUM, bus bandwidth (slowest group)")
    for col in ("communicator", "ranks", "size", "time (us)", "algbw GB/s", "busbw GB/s"):
        bw.add_column(col, justify="right" if col != "communicator" else "left")
    for r in rows:
        bw.add_row(r["comm"], str(r["ranks"]), format_size(r["bytes"]), f"{r['us']:.1f}",
                   f"{r['algbw']:.3f}", f"{r['busbw']:.3f}")
    console.print(bw)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.diagnose", description=__doc__)
    ap.add_argument("--sizes", default="1K,64K,1M,16M", help="message sizes, e.g. 1K,64K,16M")
    ap.add_argument("--iters", type=int, default=10, help="timed all-reduces per size")
    ap.add_argument("--backend", default="auto", choices=bootstrap.BACKENDS)
    args = ap.parse_args(argv)
    try:
        sizes = parse_sizes(args.sizes)
        world = bootstrap.init(backend=args.backend)
    except TrainerError as exc:
        print(f"diagnose: {exc}", file=sys.stderr, flush=True)
        return 2
    info = rank_info(world)
    print(f"[rank {info['rank']}] host={info['host']} device={info['device']} "
          f"world_size={info['world_size']} mpi={info['mpi']!r} nccl={info['nccl']} "
          f"unique_id={info['unique_id']}", flush=True)
    infos = world.mpi_comm.gather(info, root=0)
    rows = bandwidth(world, sizes, args.iters)
    if world.rank == 0:
        print_report(infos, rows)
    world.comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
