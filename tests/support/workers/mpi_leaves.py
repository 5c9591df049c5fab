"""An mpi4py program (MPICH) whose rank 1 leaves with ``sys.exit(3)`` while the others wait for
it in an Allreduce; mpi4py's exit handler puts it in MPI_Finalize, whose barrier never ends.

    python tests/support/workers/mpi_leaves.py [SECONDS]   # the others compute SECONDS first
    (default 0)
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    comm = MPI.COMM_WORLD
    buf = np.ones(1024)
    comm.Allreduce(MPI.IN_PLACE, buf)
    print(f"rank {comm.rank} of {comm.size} ready", flush=True)
    if comm.rank == 1:
        sys.exit(3)
    until = time.monotonic() + (float(sys.argv[1]) if len(sys.argv) > 1 else 0.0)
    a = np.ones((64, 64))
    while time.monotonic() < until:  # computing, not waiting: rank 1's early exit is no hang yet
        a = np.tanh(a @ a)
    comm.Allreduce(MPI.IN_PLACE, buf)
    print("the others never get here", flush=True)


if __name__ == "__main__":
    main()
