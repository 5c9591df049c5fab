"""A torch.distributed script whose entry point is decorated with torch's ``@record``, as
torchrun users write them: rank 2 raises once the process group is up, the others wait for it
in a barrier (they are stopped by the launcher).

    python tests/support/workers/record_raise.py
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def load_shard(rank: int) -> None:
    if rank == 2:
        raise ValueError(f"shard {rank} of the data set is missing")


@record
def main() -> None:
    dist.init_process_group("gloo")
    load_shard(int(os.environ["RANK"]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
