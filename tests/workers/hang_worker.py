"""Ranks that hang on purpose, for the hang-diagnosis tests (run under dtrain).

    python tests/workers/hang_worker.py skip    # dp 2 x tp 2: rank 2 skips step 3's DP all-reduce
    python tests/workers/hang_worker.py pipe    # pp 2: stage 1 stops sending at step 3
    python tests/workers/hang_worker.py busy    # 2 ranks: rank 1 computes alone for 8 s (healthy)

Each step reports itself to the progress record like the trainer does.
"""

from __future__ import annotations

import sys
import time

import torch

from trainer.comm.bootstrap import init
from trainer.comm.mesh import Mesh
from trainer.comm.progress import record_of
from trainer.comm.protocol import P2POp, wait_all
from trainer.comm.topology import MeshShape


def skip() -> None:
    world = init(backend="mpi")
    mesh = Mesh.build(world.comm, MeshShape(dp=2, tp=2), world.device)
    record = record_of(world.comm)
    t = torch.ones(256)
    for step in range(1, 6):
        mesh.group("tp").all_reduce(t)
        if not (world.rank == 2 and step == 3):  # a data-dependent branch gone wrong
            mesh.group("dp").all_reduce(t)
        record.step(step, 0.0)
        print(f"step {step}", flush=True)
    world.comm.barrier()


def pipe() -> None:
    """Two pipeline stages exchanging activations and gradients as `trainer.pipeline` does
    (one batch_p2p per transfer); stage 1 gets stuck in its compute at step 3."""
    world = init(backend="mpi")
    pp = Mesh.build(world.comm, MeshShape(pp=2), world.device).group("pp")
    record = record_of(world.comm)
    act, grad = torch.ones(64), torch.ones(64)
    for step in range(1, 6):
        if pp.rank == 0:
            wait_all(pp.batch_p2p([P2POp("send", act, 1)]))
            wait_all(pp.batch_p2p([P2POp("recv", grad, 1)]))
        else:
            wait_all(pp.batch_p2p([P2POp("recv", act, 0)]))
            while step == 3:
                time.sleep(1)
            wait_all(pp.batch_p2p([P2POp("send", grad, 0)]))
        record.step(step, 0.0)
    world.comm.barrier()


def busy() -> None:
    """Not a hang: rank 1 computes alone for 8 s (as rank 0 of a real job writes a checkpoint
    the others do not) while rank 0 waits for it in the next all-reduce."""
    world = init(backend="mpi")
    record = record_of(world.comm)
    t, a = torch.ones(8), torch.ones(128, 128)
    for step in range(1, 4):
        if world.rank == 1 and step == 2:
            until = time.monotonic() + 8.0
            while time.monotonic() < until:
                a = torch.tanh(a @ a)
        world.comm.all_reduce(t)
        record.step(step, 0.0)
    print(f"rank {world.rank} done", flush=True)


if __name__ == "__main__":
    {"skip": skip, "pipe": pipe, "busy": busy}[sys.argv[1]]()
