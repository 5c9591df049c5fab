"""What a backend's communicator knows about itself: its rank, size, group name and the MPI
communicator of the same ranks (used for bootstrap traffic, metadata and NCCL unique ids)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # handed in: importing mpi4py here would initialise MPI at import
    from mpi4py import MPI


class GroupMember:
    """Rank, size and name of one member of a group, read once from its MPI communicator."""

    def __init__(self, mpi_comm: MPI.Comm, name: str) -> None:
        self._mpi = mpi_comm
        self._name = name
        self._rank = mpi_comm.Get_rank()
        self._size = mpi_comm.Get_size()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def name(self) -> str:
        return self._name

    @property
    def mpi_comm(self) -> MPI.Comm:
        """The MPI communicator of this group's ranks."""
        return self._mpi

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._name!r}, rank={self._rank}, size={self._size})"
