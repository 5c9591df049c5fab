"""The trainer's communication layer: one `Communicator` protocol, an MPI and an NCCL backend.

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
