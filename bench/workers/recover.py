"""A rank for `bench.recovery`: a torch.distributed (gloo, env://) loop that one rank of the
first attempt leaves by crashing, the same program under torchrun and under dtrain.

    python recover.py OUT STEPS CRASH_RANK CRASH_STEP

Both launchers set ``TORCHELASTIC_RESTART_COUNT`` (the attempt), ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``. The process group's keys get a prefix per attempt: torchrun
keeps one store (its agent's) for every attempt, and a plain ``env://`` init of the second
attempt read the first attempt's gloo addresses there and failed (torch 2.13); under dtrain
rank 0 hosts a new store each round, where the prefix changes nothing. Each rank writes
``OUT/a<attempt>-r<rank>.json``: when its process started (before any import), when its first
step completed, and on the crashing rank when it crashed (``os._exit(1)`` at CRASH_STEP of
attempt 0, with no goodbye to the others).
"""

from __future__ import annotations

import time

STARTED = time.time()

import json  # noqa: E402 - the stamp above is taken before any import
import os  # noqa: E402
import sys  # noqa: E402


def main() -> int:
    out, steps, crash_rank, crash_step = sys.argv[1], *map(int, sys.argv[2:5])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_store)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}", store),
                            rank=rank, world_size=world)
    stamps = {"rank": rank, "attempt": attempt, "start": STARTED}
    path = os.path.join(out, f"a{attempt}-r{rank}.json")
    t = torch.ones(1024)
    for step in range(1, steps + 1):
        dist.all_reduce(t)
        if step == 1:
            stamps["first_step"] = time.time()
            _write(path, stamps)
        if attempt == 0 and rank == crash_rank and step == crash_step:
            stamps["crash"] = time.time()
            _write(path, stamps)
            os._exit(1)
        time.sleep(0.02)
    dist.destroy_process_group()
    return 0


def _write(path: str, stamps: dict[str, float]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(stamps, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
