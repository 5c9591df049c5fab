"""Rank program for the wire-up bench: stamps at start, after MPI_Init, after a barrier.

    python mpi_stamp.py STAMP_DIR

Importing ``mpi4py.MPI`` runs MPI_Init (mpi4py's default), which is where MPICH's PMI-1 client
talks to the process manager: get_maxes, kvsname, process mapping, put of its business card,
barrier. The stamp after it is "this rank is past MPI_Init"; the barrier after that makes
every rank talk to every other (the world is really formed, not just each rank's PMI part).
World size and rank go in the stamp so the bench can reject a world of singletons.
"""

import importlib
import os
import socket
import sys
import time

from stamp import write_stamp  # this directory is sys.path[0] when run as a script


def main() -> None:
    start = time.time()
    mpi = importlib.import_module("mpi4py.MPI")  # after the start stamp: MPI_Init is timed
    init = time.time()
    world = mpi.COMM_WORLD
    world.Barrier()
    barrier = time.time()
    write_stamp(sys.argv[1], {"host": socket.gethostname(), "pid": os.getpid(),
                              "rank": world.rank, "size": world.size,
                              "start": start, "init": init, "barrier": barrier})


if __name__ == "__main__":
    main()
