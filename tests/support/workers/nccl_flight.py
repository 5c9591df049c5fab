"""A plain torch.distributed program on NCCL (one GPU per rank), for the shim's GPU tests.

    python tests/support/workers/nccl_flight.py record SECONDS   # any number of ranks
    python tests/support/workers/nccl_flight.py skip              # 2 ranks or more

``record``: three all-reduces on the world, then a batched send and receive to itself
(``batch_isend_irecv``: NCCL coalesces them), then it sleeps SECONDS so the shim writes what
it saw. ``skip``: rank 1 leaves out the world's third all-reduce and sleeps; the others wait in
it (NCCL's host side waits in the synchronisation after it).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    mode = sys.argv[1]
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank = dist.get_rank()
    t = torch.ones(256, device=device)
    for step in range(1, 4):
        if mode == "skip" and step == 3 and rank == 1:
            time.sleep(3600)
        dist.all_reduce(t)
        torch.cuda.synchronize()
    if mode == "record":
        send, recv = torch.ones(64, device=device), torch.empty(64, device=device)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, rank),
                                            dist.P2POp(dist.irecv, recv, rank)]):
            work.wait()
        torch.cuda.synchronize()
        time.sleep(float(sys.argv[2]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
