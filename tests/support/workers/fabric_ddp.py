"""A Lightning Fabric CPU DDP script as its users write it, nothing of dtrain in it: it runs
unchanged under torchrun and under `dtrain launch` (tests/cluster/test_frameworks_cluster.py).

    python fabric_ddp.py --devices 2 --num-nodes 2

Each rank trains a linear model on its own data for a few steps; every step it prints one JSON
line: its rank, the world size, the step and the loss averaged over all ranks.
"""

import argparse
import json
import os
import sys

import torch
from lightning_fabric import Fabric


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=args.devices,
                    num_nodes=args.num_nodes)
    fabric.launch()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    model, optimizer = fabric.setup(model, optimizer)
    data = torch.Generator().manual_seed(100 + fabric.global_rank)
    for step in range(1, args.steps + 1):
        x = torch.randn(16, 8, generator=data, dtype=torch.float64).float()
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        mean = fabric.all_reduce(loss.detach(), reduce_op="mean")
        # One write per record: torchrun's local ranks share one pipe, and with
        # PYTHONUNBUFFERED print() writes the text and its newline separately.
        record = {"rank": fabric.global_rank, "world": fabric.world_size,
                  "node": fabric.node_rank, "local": fabric.local_rank, "step": step,
                  "loss": float(mean),
                  "env": type(fabric._connector.cluster_environment).__name__}
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
    # torch 2.13 and gloo, under torchrun too: a process group left to interpreter exit aborts
    # it (SIGABRT), and one whose last reference is DDP's reducer deadlocks its teardown (its
    # worker thread wants the GIL the deleting thread holds). Free the model first.
    del model, optimizer
    torch.distributed.destroy_process_group()
    # The group's gloo threads outlive that call all the same (the DDP model built on it keeps
    # them; tests/support/workers/gloo_threads.py) and would race the interpreter's teardown (see
    # accelerate_train.py): every record is out, so leave without it.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
