"""Ranks for the restart tests (run under `dtrain launch --max-restarts`): what a rank does
depends on its round (``DTRAIN_RESTART_COUNT``). Every rank first prints one JSON line: its
round, rank, world size and host.

    restart_worker.py sleep-first        round 0: every rank prints "up" and sleeps (to be
                                         killed); later rounds exit 0
    restart_worker.py fail RANK CODE     rank RANK exits CODE in every round; the others sleep
                                         until dtrain stops them
    restart_worker.py hang RANK          round 0: rank RANK never enters step 2's all-reduce
                                         (the others wait in it); later rounds: 3 steps, exit 0

Only ``hang`` imports torch and MPI (it reports steps and collectives to its progress record,
as the trainer does, for the hang diagnosis); the others start in a few milliseconds.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time


def main() -> int:
    mode, args = sys.argv[1], sys.argv[2:]
    rounds, rank = int(os.environ["DTRAIN_RESTART_COUNT"]), int(os.environ["RANK"])
    print(json.dumps({"round": rounds, "rank": rank, "world": int(os.environ["WORLD_SIZE"]),
                      "host": socket.gethostname()}), flush=True)
    if mode == "sleep-first":
        if rounds == 0:
            print("up", flush=True)
            time.sleep(120)
        return 0
    if mode == "fail":
        if rank == int(args[0]):
            return int(args[1])
        time.sleep(120)
        return 0
    if mode == "hang":
        return hang(int(args[0]), rounds)
    raise SystemExit(f"unknown mode {mode!r}")


def hang(culprit: int, rounds: int) -> int:
    import torch

    from trainer.comm.bootstrap import init
    from trainer.comm.progress import record_of

    world = init(backend="mpi")
    record = record_of(world.comm)
    t = torch.ones(64)
    for step in range(1, 4):
        while rounds == 0 and step == 2 and world.rank == culprit:
            time.sleep(1)  # a rank stuck before the collective: the others wait in it
        world.comm.all_reduce(t)
        if record is not None:
            record.step(step, 0.0)
    world.comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
