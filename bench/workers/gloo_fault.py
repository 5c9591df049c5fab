"""A plain torch.distributed (gloo) program with one seeded fault, for `bench.flight`.

    python bench/workers/gloo_fault.py KIND SEED STAMP   # KIND: skip, mismatch, stop, early,
                                                         # sleep, none

Every rank runs the same random choice (``SEED``): the culprit rank and the step of the
fault (2 to 4); each step all-reduces within the rank's pair (``new_group``: {0, 1}, {2, 3},
...), then on the world. At the fault's step the culprit ``skip``s its pair's all-reduce,
``mismatch``es (all_gather where the others all-reduce on the world), ``stop``s itself
(SIGSTOP), returns from its main (``early``) or ``sleep``s for an hour, having written the wall
time to STAMP first. The culprit's rank is printed by rank 0 (``culprit R``).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    kind, seed, stamp = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    rng = random.Random(seed)
    culprit, fault_step = rng.randrange(size), rng.randint(2, 4)
    pairs = [dist.new_group([r, r + 1]) for r in range(0, size - 1, 2)]
    pair = pairs[min(rank // 2, len(pairs) - 1)]
    if rank == 0:
        print(f"culprit {culprit}", flush=True)
    t = torch.ones(256)
    for step in range(1, 6):
        at = step == fault_step and rank == culprit and kind != "none"
        if at:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
        if not (at and kind == "skip"):
            dist.all_reduce(t, group=pair)
        if at and kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if at and kind == "early":
            return
        if at and kind == "sleep":
            time.sleep(3600)
        if at and kind == "mismatch":
            dist.all_gather([torch.empty(256) for _ in range(size)], t)
        else:
            dist.all_reduce(t)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
