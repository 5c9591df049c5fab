"""An Accelerate CPU script as its users write it, nothing of dtrain in it: it runs unchanged
under torchrun and under `dtrain launch` (tests/cluster/test_frameworks_cluster.py).

Each rank trains a linear model on its own data for a few steps; every step it prints one JSON
line: its rank, the world size, the step and the loss averaged over all ranks.
"""

import json
import os
import sys

import torch
from accelerate import Accelerator


def main(steps: int = 4) -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = torch.Generator().manual_seed(100 + accelerator.process_index)
    for step in range(1, steps + 1):
        x = torch.randn(16, 8, generator=data, dtype=torch.float64).float()
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        mean = accelerator.reduce(loss.detach(), reduction="mean")
        # One write per record: torchrun's local ranks share one pipe, and with
        # PYTHONUNBUFFERED print() writes the text and its newline separately.
        record = {"rank": accelerator.process_index, "world": accelerator.num_processes,
                  "local": accelerator.local_process_index, "step": step,
                  "loss": float(mean), "type": str(accelerator.distributed_type)}
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
    # As Accelerate's examples end.
    del model, optimizer
    accelerator.end_training()
    # Then leave without interpreter teardown. torch 2.13's DDP keeps its gloo process group
    # alive past destroy_process_group (the group's worker threads and gloo's I/O loop stay:
    # tests/support/workers/gloo_threads.py), so those threads run on into the interpreter's
    # finalization; one dropping the last reference to a collective's tensor there takes the
    # GIL, and the process aborts ("terminate called without an active exception", seen once
    # under dtrain, 2026-11-27) or deadlocks with a destructor holding the GIL (the hung
    # torchrun reference of the same day). Every record is out and flushed by now.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
