"""A plain torch.distributed (gloo) program, as users write them for torchrun, with one fault
in its last step; it knows nothing of dtrain.

    python tests/support/workers/gloo_faults.py FAULT     # FAULT: skip, mismatch, stop, early, none
    python tests/support/workers/gloo_faults.py long SECONDS   # one healthy all-reduce that long
    python tests/support/workers/gloo_faults.py send READY GO
        # each step rank 2 sends 4 MiB to rank 0, then all all-reduce on the world; before the
        # third send rank 2 creates READY and spins until GO exists (the test cuts its host's
        # link to rank 0's meanwhile, so the send never arrives)

4 ranks in two pairs ({0, 1}, {2, 3}: `new_group`); each step all-reduces within the pair, then
on the world. In step 3: ``skip``: rank 1 leaves out its pair's all-reduce; ``mismatch``: rank 2
calls all_gather where the others all-reduce on the world; ``stop``: rank 3 stops itself
(SIGSTOP) before the world's all-reduce; ``early``: rank 3 returns from its main there
instead (without destroying its process group).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    fault = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    if fault == "long":
        return long_all_reduce(float(sys.argv[2]))
    if fault == "send":
        return send_stall(Path(sys.argv[2]), Path(sys.argv[3]))
    t = torch.ones(256)
    for step in range(1, 4):
        last = step == 3
        if not (fault == "skip" and last and rank == 1):
            dist.all_reduce(t, group=pair)
        if fault == "early" and last and rank == 3:
            return  # leaves its main with the process group up, the others in all_reduce
        if fault == "stop" and last and rank == 3:
            os.kill(os.getpid(), signal.SIGSTOP)
        if fault == "mismatch" and last and rank == 2:
            dist.all_gather([torch.empty(256) for _ in range(4)], t)
        else:
            dist.all_reduce(t)
        print(f"rank {rank} step {step}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def send_stall(ready: Path, go: Path) -> None:
    """Rank 2 sends to rank 0, then every rank joins an all-reduce, 3 steps; rank 2 spins (as
    a rank computing: no hang until it sends) until GO before its last send."""
    rank = dist.get_rank()
    big, t = torch.ones(1 << 20), torch.ones(8)
    for step in range(1, 4):
        if rank == 2:
            if step == 3:
                ready.touch()
                until = time.monotonic() + 120
                while not go.exists() and time.monotonic() < until:
                    pass
            dist.send(big, 0)
        elif rank == 0:
            dist.recv(big, 2)
        dist.all_reduce(t)
        print(f"rank {rank} step {step}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def long_all_reduce(seconds: float) -> None:
    """One healthy all-reduce sized to last about ``seconds`` on this machine (rank 0 times a
    64 MiB one, warm: the first moves pages in and is slower, and scales, capped at 2 GiB a
    rank); prints how long it took."""
    probe = torch.ones(16 << 20)
    dist.all_reduce(probe)
    started = time.monotonic()
    dist.all_reduce(probe)
    numel = torch.tensor([min(1 << 29, int((16 << 20) * seconds / (time.monotonic() - started)))])
    dist.broadcast(numel, 0)
    del probe
    t = torch.ones(int(numel.item()))
    dist.barrier()
    started = time.monotonic()
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} all_reduce {time.monotonic() - started:.2f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
