"""Ranks that hang on purpose, for the hang-diagnosis tests (run under dtrain).

    python tests/support/workers/hang_worker.py skip    # dp 2 x tp 2: rank 2 skips step 3's DP
    all-reduce
    python tests/support/workers/hang_worker.py pipe    # pp 2: stage 1 stops sending at step 3
    python tests/support/workers/hang_worker.py busy    # 2 ranks: rank 1 computes alone for 8 s
    (healthy)
    python tests/support/workers/hang_worker.py sendstall READY GO
        # 4 ranks: rank 2 sends 4 MiB to rank 0 each step; before the last send it creates
        # READY and spins until GO exists (the test cuts its host's link to rank 0's meanwhile)
    python tests/support/workers/hang_worker.py leave KIND FAMILY RANK [NUMEL]
        # dp 2 x tp 2: every step runs each operation kind on the TP group, a DP all-reduce and
        # each kind on the world (`tests.launcher.test_hang_blame.step_ops`); RANK leaves out KIND
        # on
        # FAMILY (tp or world) in the last step

Each step reports itself to the progress record like the trainer does.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

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
    """Two pipeline stages exchanging activations and gradients as `trainer.parallel.pipeline` does
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


def sendstall() -> None:
    """Rank 2 sends to rank 0, then every rank joins an all-reduce, 3 steps; the last send is
    posted only once the test has made node2's packets to node1 vanish, so it never arrives.
    Rank 2 spins while it waits for the test, as a rank computing (no hang until it sends)."""
    ready, go = Path(sys.argv[2]), Path(sys.argv[3])
    world = init(backend="mpi")
    record = record_of(world.comm)
    big, t = torch.ones(1 << 20), torch.ones(8)  # 4 MiB: a rendezvous send, it blocks
    for step in range(1, 4):
        if world.rank == 2:
            if step == 3:
                ready.touch()
                until = time.monotonic() + 120
                while not go.exists() and time.monotonic() < until:
                    pass
            world.comm.send(big, 0)
        elif world.rank == 0:
            world.comm.recv(big, 2)
        world.comm.all_reduce(t)
        record.step(step, 0.0)


KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")
STEPS = 3


def leave() -> None:
    kind, family, skipper = sys.argv[2], sys.argv[3], int(sys.argv[4])
    numel = int(sys.argv[5]) if len(sys.argv) > 5 else 256
    world = init(backend="mpi")
    mesh = Mesh.build(world.comm, MeshShape(dp=2, tp=2), world.device)
    record = record_of(world.comm)
    comms = {"tp": mesh.group("tp"), "dp": mesh.group("dp"), "world": world.comm}
    t = torch.ones(numel)
    for step in range(1, STEPS + 1):
        for fam, k in [*(("tp", k) for k in KINDS), ("dp", "all_reduce"),
                       *(("world", k) for k in KINDS)]:
            if not (world.rank == skipper and step == STEPS and (fam, k) == (family, kind)):
                _run(comms[fam], k, t)
        record.step(step, 0.0)
    world.comm.barrier()


def _run(comm, kind: str, t: torch.Tensor) -> None:
    n = comm.size
    if kind == "all_reduce":
        comm.all_reduce(t)
    elif kind == "all_gather":
        comm.all_gather(torch.empty(n * t.numel()), t)
    elif kind == "reduce_scatter":
        comm.reduce_scatter(torch.empty(t.numel() // n), t)
    elif kind == "broadcast":
        comm.broadcast(t, 0)
    else:  # a ring exchange, as a pipeline's batched send and receive
        got = torch.empty_like(t)
        wait_all(comm.batch_p2p([P2POp("send", t, (comm.rank + 1) % n),
                                 P2POp("recv", got, (comm.rank - 1) % n)]))


if __name__ == "__main__":
    {"skip": skip, "pipe": pipe, "busy": busy, "leave": leave,
     "sendstall": sendstall}[sys.argv[1]]()
