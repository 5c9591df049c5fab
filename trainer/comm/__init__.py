"""The trainer's communication layer: one `Communicator` protocol, an MPI and an NCCL backend.

    protocol   the `Communicator` every backend implements: collectives, p2p, async handles
    bootstrap  join the job: MPI world, device, the world communicator
    topology   the named axes of a layout (tp, ep, edp, pp; dp = ep x edp), rank arithmetic
    mesh       one rank's `Mesh`: every group of every axis, size 1 included
    member     rank, size and name of a group member, read once
    checks     the argument checks every backend shares
    timing     exposed and total communication time per step
    progress   the per-rank progress record the launcher reads (hangs, stragglers)
    bandwidth  all-reduce bandwidth (`python -m trainer.diagnose`)
    mpi/       the MPI backend (CPU, DLPack); nccl/: the NCCL backend (nccl4py)

Importing this package starts nothing: MPI is initialised by `bootstrap.init` (or by importing
`trainer.comm.mpi.communicator`), and nccl4py is imported only when the NCCL backend is used.
"""

from trainer.comm.protocol import (
    Communicator,
    DoneHandle,
    Handle,
    P2POp,
    ReduceOp,
    wait_all,
)
from trainer.comm.topology import AXES, MeshShape

__all__ = [
    "AXES", "Communicator", "DoneHandle", "Handle", "MeshShape", "P2POp", "ReduceOp",
    "wait_all",
]
