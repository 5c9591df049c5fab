"""Rank program for the wire-up bench: stamps at start, after MPI_Init, after a barrier.

    python mpi_stamp.py STAMP_DIR

``from mpi4py import MPI`` runs MPI_Init (mpi4py's default), which is where MPICH's PMI-1
client talks to the process manager: get_maxes, kvsname, process mapping, put of its business
card, barrier. The stamp after it is "this rank is past MPI_Init"; the barrier after that makes
every rank talk to every other (the world is really formed, not just each rank's PMI part).
World size and rank go in the stamp so the bench can reject a world of singletons.
"""

import time

START = time.time()

import json
import os
import socket
import sys

from mpi4py import MPI

INIT = time.time()
MPI.COMM_WORLD.Barrier()
BARRIER = time.time()


def main() -> None:
    host, pid = socket.gethostname(), os.getpid()
    world = MPI.COMM_WORLD
    stamp = {"host": host, "pid": pid, "rank": world.rank, "size": world.size,
             "start": START, "init": INIT, "barrier": BARRIER}
    path = os.path.join(sys.argv[1], f"{host}-{pid}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(stamp, f)
    os.rename(path + ".tmp", path)


if __name__ == "__main__":
    main()
