"""Why the framework scripts leave with ``os._exit`` (tests/cluster/test_frameworks_cluster.py).

A one-rank gloo world, optionally a DDP model built and freed, then ``destroy_process_group``;
prints the names of the threads the process still has (Linux: /proc/self/task/*/comm).

    python gloo_threads.py plain|ddp
"""

import gc
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist


def threads() -> list[str]:
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip()
                  for t in os.listdir("/proc/self/task"))


def main(mode: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", rank=0, world_size=1,
                                init_method="file://" + os.path.join(folder, "store"))
        if mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
            del model
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
        sys.stdout.write(json.dumps(threads()) + "\n")
        sys.stdout.flush()
    os._exit(0)  # the threads this reports would race the interpreter's teardown


if __name__ == "__main__":
    main(sys.argv[1])
