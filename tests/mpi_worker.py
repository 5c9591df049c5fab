"""Entry point shared by the test programs that run as MPI ranks under mpiexec."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from pathlib import Path


def run_or_abort(main: Callable[[Path], None]) -> None:
    """`main(Path(argv[1]))`; any failure aborts every rank, so tests fail instead of hanging."""
    try:
        main(Path(sys.argv[1]))
    except BaseException:  # noqa: BLE001 - one rank's failure must not leave the others waiting
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
