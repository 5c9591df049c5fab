"""Contract worker: every Communicator operation, on every communicator shape, every dtype, sync
and async, compared with the serial result. Started by tests/trainer/test_comm_contract.py as

    mpiexec -n N python tests/support/comm_workers/contract.py --out DIR [--backend mpi|nccl]

Each rank writes DIR/rank<R>.json (one record per case) and exits 1 if any case failed. One run
covers a whole world size, because starting MPI ranks with torch costs seconds on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cases
import torch

from trainer.comm import bootstrap
from trainer.comm.mesh import Mesh
from trainer.comm.protocol import ReduceOp
from trainer.comm.topology import MeshShape
from trainer.errors import CommError


def split_group(world: bootstrap.World, label: str, color_of, key_of) -> cases.Group:
    n, r = world.size, world.rank
    members = tuple(sorted((q for q in range(n) if color_of(q) == color_of(r)),
                           key=lambda q: (key_of(q), q)))
    return cases.Group(label, world.comm.split(color_of(r), key_of(r), name=label), members)


def groups(world: bootstrap.World) -> list[cases.Group]:
    """World, splits 2x2 both ways, a reversed-key split, and the axes of a (dp, tp=2) grid."""
    out = [cases.Group("world", world.comm, tuple(range(world.size)))]
    out.append(split_group(world, "rows", lambda q: q // 2, lambda q: q))
    out.append(split_group(world, "cols", lambda q: q % 2, lambda q: q))
    out.append(split_group(world, "reversed", lambda q: 0, lambda q: -q))
    tp = 2 if world.size % 2 == 0 else 1
    shape = MeshShape(dp=world.size // tp, tp=tp, pp=1)
    grid = Mesh.build(world.comm, shape, world.device)
    for axis in ("tp", "dp", "pp"):
        out.append(cases.Group(f"grid_{axis}", grid.group(axis),
                               shape.group_ranks(world.rank, axis)))
    return out


def check_sub_ranks(group: cases.Group, rank: int) -> None:
    if group.comm.size != len(group.members) or group.members[group.comm.rank] != rank:
        raise AssertionError(
            f"{group.label}: rank {group.comm.rank} of {group.comm.size}, expected position of "
            f"global rank {rank} in {group.members}")


def run_case(name: str, thunk) -> dict:
    try:
        for actual, expected in thunk():
            got = actual.detach().cpu()
            if got.dtype != expected.dtype or not torch.equal(got, expected):
                return {"ok": False, "error": f"got {got.tolist()} expected {expected.tolist()}"}
        return {"ok": True, "error": ""}
    except Exception:  # noqa: BLE001 - recorded, so the other cases still run and are reported
        return {"ok": False, "error": traceback.format_exc(limit=4)}


def error_cases(world: bootstrap.World) -> list[dict]:
    """Rank-local argument checks: a CommError naming op, communicator and rank, nothing sent."""
    c, dev = world.comm, world.device
    bad = {
        "all_gather_wrong_shape": lambda: c.all_gather(torch.zeros(3, device=dev),
                                                       torch.zeros(2, device=dev)),
        "avg_of_integers": lambda: c.all_reduce(torch.zeros(2, dtype=torch.int64, device=dev),
                                                ReduceOp.AVG),
        "broadcast_from_outside": lambda: c.broadcast(torch.zeros(2, device=dev), world.size),
        "negative_split_color": lambda: c.split(-1, 0),
        "reduce_scatter_uneven": lambda: c.reduce_scatter(
            torch.zeros(2, device=dev), torch.zeros(2 * world.size + 1, device=dev)),
        "all_to_all_splits_miscount": lambda: c.all_to_all(
            torch.zeros(world.size, 2, device=dev), torch.zeros(world.size, 2, device=dev),
            in_splits=[2] * world.size, out_splits=[1] * world.size),
        "all_to_all_row_shapes_differ": lambda: c.all_to_all(
            torch.zeros(world.size, 3, device=dev), torch.zeros(world.size, 2, device=dev)),
    }
    out = []
    for name, call in bad.items():
        try:
            call()
            result = {"ok": False, "error": "no CommError raised"}
        except CommError as exc:
            text = str(exc)
            ok = f"rank {c.rank} of {c.size}" in text and "failed" in text
            result = {"ok": ok, "error": "" if ok else f"message lacks op/rank: {text}"}
        out.append({"case": f"errors/{name}", "op": "errors", **result})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="mpi", choices=["mpi", "nccl"])
    args = ap.parse_args()
    world = bootstrap.init(backend=args.backend)
    records = [{"case": "bootstrap", "op": "bootstrap", **run_case("bootstrap", lambda: [
        (torch.tensor([world.size, world.local_rank, world.local_size]),
         torch.tensor([int(os.environ["PMI_SIZE"]), world.rank, world.size]))])}]
    for group in groups(world):
        check_sub_ranks(group, world.rank)
        for dname, dtype in cases.DTYPES.items():
            for async_op in (False, True):
                tag = f"{group.label}/{dname}/{'async' if async_op else 'sync'}"
                ctx = cases.Ctx(group, dtype, async_op, world.device, tag)
                for op, thunk in cases.plan(ctx):
                    records.append({"case": f"{tag}/{op}", "op": op, "comm": group.label,
                                    "dtype": dname, "async": async_op, **run_case(op, thunk)})
    records += error_cases(world)
    world.comm.barrier()
    report = {"rank": world.rank, "size": world.size, "backend": world.comm.backend,
              "records": records}
    Path(args.out, f"rank{world.rank}.json").write_text(json.dumps(report))
    failed = [r["case"] for r in records if not r["ok"]]
    passed = len(records) - len(failed)
    print(f"[rank {world.rank}] {passed}/{len(records)} cases passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
