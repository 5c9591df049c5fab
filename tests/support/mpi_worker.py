"""The entry every rank of a test's MPI run executes: call one rank function, save its result.

    mpiexec -n 4 python -m tests.support.mpi_worker tests.support.dp_workers.equivalence:run OUT

``run(out: Path) -> dict`` runs on every rank; what it returns is saved to ``OUT/rank<r>.pt``
for `tests.support.mpi_runs.world_run` to load. Any failure aborts every rank, so the test sees a
failure instead of a hang.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path


def main(target: str, out: Path) -> None:
    module, _, function = target.partition(":")
    result = getattr(importlib.import_module(module), function)(out)
    import torch
    from mpi4py import MPI

    torch.save(result, out / f"rank{MPI.COMM_WORLD.rank}.pt")


if __name__ == "__main__":
    try:
        main(sys.argv[1], Path(sys.argv[2]))
    except BaseException:  # noqa: BLE001 - one rank's failure must not leave the others waiting
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
