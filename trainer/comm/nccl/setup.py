"""Lazy nccl4py import, version string and the unique-id broadcast (rank 0 creates, MPI carries).

Kept apart from the communicator so that bootstrap and diagnose can check NCCL's availability
on every rank before any rank enters a collective NCCL call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.errors import BootstrapError

if TYPE_CHECKING:
    from mpi4py import MPI


def import_nccl() -> Any:
    """The ``nccl.core`` module, or a `BootstrapError` saying how to install it."""
    try:
        import nccl.core as nccl
    except ImportError as exc:
        raise BootstrapError(
            "NCCL backend unavailable", "import nccl.core", f"nccl4py cannot be imported ({exc})",
            "Install it with `pip install 'nccl4py[cu12]'` (cu13 for CUDA 13 torch builds), "
            "or run on CPU with init(backend='mpi')",
        ) from None
    return nccl


def nccl_version() -> str:
    """nccl4py's and libnccl's versions as one line (API differs between nccl4py releases)."""
    nccl = import_nccl()
    if hasattr(nccl, "get_version"):
        return str(nccl.get_version())
    return f"libnccl {nccl.get_lib_version()}"


def share_unique_id(mpi_comm: MPI.Comm) -> Any:
    """Rank 0 of ``mpi_comm`` creates an NCCL unique id and broadcasts it; every rank returns it."""
    nccl = import_nccl()
    message: tuple[str, Any] | None = None
    if mpi_comm.Get_rank() == 0:
        try:
            message = ("ok", bytes(nccl.get_unique_id().as_bytes))
        except Exception as exc:  # noqa: BLE001 - broadcast it: the other ranks wait in bcast
            message = ("error", f"{type(exc).__name__}: {exc}")
    status, payload = mpi_comm.bcast(message, root=0)
    if status != "ok":
        raise BootstrapError(
            "NCCL unique id not created", "rank 0 of the group", payload,
            "Check that libnccl is installed (nvidia-nccl-cu12) and a GPU is visible",
        )
    return nccl.UniqueId.from_bytes(payload)
