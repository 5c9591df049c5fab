"""A DeepSpeed CPU script as its users write it, nothing of dtrain in it
(tests/cluster/test_frameworks_cluster.py): DeepSpeed's accelerator, chosen by DS_ACCELERATOR,
names the
device and the communication backend; one all-reduce on them.

Each rank prints one JSON line: its rank, the world size, the accelerator DeepSpeed chose,
DS_ACCELERATOR as the rank sees it and the sum of all ranks' numbers.
"""

import json
import os

import torch
from deepspeed.accelerator import get_accelerator


def main() -> None:
    accelerator = get_accelerator()
    torch.distributed.init_process_group(accelerator.communication_backend_name())
    rank = torch.distributed.get_rank()
    total = torch.tensor([float(rank)], device=accelerator.device_name())
    torch.distributed.all_reduce(total)
    print(json.dumps({"rank": rank, "world": torch.distributed.get_world_size(),
                      "accelerator": accelerator.device_name(),
                      "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR"),
                      "sum": float(total)}), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
