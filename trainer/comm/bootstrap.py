"""Join the job: MPI world, device and the world communicator (`trainer.comm.mesh` splits it).

``init()`` works the same under ``dtrain launch`` (the worker contract of ``workerenv`` is set and
PMI-1 comes from the launcher), under plain ``mpiexec -n N`` (no contract: MPI's rank and size,
local rank from the shared-memory split) and as a plain ``python`` process (a world of one).

Under the contract, MPI's world must be the job's world. When it is not, the usual causes are an
MPI library that cannot speak to dtrain's PMI-1 server (Open MPI 5 speaks only PMIx: each rank
then starts as a singleton world of one) or a worker started by hand or by torchrun with
``RANK``/``WORLD_SIZE`` copied into its environment; `check_world` names the cause it sees.

Nothing is global: `World` (and the `trainer.comm.mesh.Mesh` built on it) are explicit objects
passed to whoever needs them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

import workerenv
from trainer.comm.progress import recorded
from trainer.comm.protocol import Communicator
from trainer.errors import BootstrapError

BACKENDS = ("auto", "mpi", "nccl")


@dataclass(frozen=True)
class World:
    """This process's place in the job and the world communicator."""

    rank: int
    size: int
    local_rank: int
    device: torch.device
    comm: Communicator
    mpi_comm: Any
    local_size: int = 1


@dataclass(frozen=True)
class Seat:
    """Rank, size and local rank as decided before any communicator exists (pure)."""

    rank: int
    size: int
    local_rank: int
    local_size: int


def check_world(
    mpi_rank: int, mpi_size: int, environ: Mapping[str, str], mpi_library: str
) -> Seat | None:
    """Compare MPI's world with the worker contract; ``None`` when there is no contract.

    Pure, so every mismatch message is tested without starting processes.
    """
    if not workerenv.in_launched_job(environ):
        return None
    try:
        env = workerenv.WorkerEnv.from_environ(environ)
    except workerenv.ContractError as exc:
        raise BootstrapError("worker environment unusable", "RANK/WORLD_SIZE", str(exc)) from None
    where = f"rank {env.rank} of WORLD_SIZE={env.world_size}"
    if mpi_size != env.world_size:
        raise BootstrapError(
            "MPI world does not match the job", where,
            f"MPI.COMM_WORLD has {mpi_size} rank(s) but the launcher started {env.world_size}",
            _mismatch_fix(mpi_size, environ, mpi_library),
        )
    if mpi_rank != env.rank:
        raise BootstrapError(
            "MPI rank does not match the job", where,
            f"MPI.COMM_WORLD rank is {mpi_rank} but RANK is {env.rank}",
            "Do not override RANK or PMI_RANK; start the job with `dtrain launch`",
        )
    return Seat(env.rank, env.world_size, env.local_rank, env.local_world_size)


def _mismatch_fix(mpi_size: int, environ: Mapping[str, str], mpi_library: str) -> str:
    has_pmi = any(k in environ for k in (workerenv.PMI_FD, workerenv.PMI_PORT))
    if "open mpi" in mpi_library.lower():
        return ("mpi4py is linked to Open MPI, which cannot join dtrain's PMI-1 wire-up: "
                "use `dtrain launch --launcher mpirun`, or install the MPICH wheel "
                "(`pip install mpich mpi4py`) in the workers' environment")
    if mpi_size == 1 and not has_pmi:
        return ("the process has RANK/WORLD_SIZE but no PMI_FD/PMI_PORT, so it was started "
                "outside dtrain (by hand, torchrun or a copied environment): start it with "
                "`dtrain launch`, or with `mpiexec -n N` and no RANK/WORLD_SIZE set")
    return (f"the MPI library ({mpi_library.splitlines()[0] if mpi_library else 'unknown'}) "
            "formed a different world: check that every host runs the same MPICH-ABI library, "
            "or use `dtrain launch --launcher mpirun`")


def init(*, backend: str = "auto", environ: Mapping[str, str] | None = None) -> World:
    """Join the MPI world, pick the device from LOCAL_RANK and build the world communicator."""
    if backend not in BACKENDS:
        raise BootstrapError(
            "unknown communication backend", f"backend={backend!r}",
            f"the backends are {', '.join(BACKENDS)}", "Pass one of them",
        )
    mpi = import_mpi()
    world = mpi.COMM_WORLD
    env = os.environ if environ is None else environ
    seat = check_world(world.Get_rank(), world.Get_size(), env, mpi.Get_library_version())
    if seat is None:
        seat = _seat_from_mpi(mpi, world)
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "mpi"
    if backend == "nccl":
        return _init_nccl(seat, world)
    from trainer.comm.mpi.communicator import MpiCommunicator

    return World(seat.rank, seat.size, seat.local_rank, torch.device("cpu"),
                 recorded(MpiCommunicator(world, "world"), env), world, seat.local_size)


def import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except Exception as exc:  # noqa: BLE001 - MPI_Init failures (e.g. a stale PMIX_* variable)
        raise BootstrapError(
            "MPI could not start", "from mpi4py import MPI", f"{type(exc).__name__}: {exc}",
            "Start workers with `dtrain launch` or `mpiexec`, and unset inherited PMI_*/PMIX_* "
            "variables of another job",
        ) from None
    return MPI


def _seat_from_mpi(mpi: Any, world: Any) -> Seat:
    """No worker contract: plain mpiexec (or python). Local rank = rank among this host's ranks."""
    local = world.Split_type(mpi.COMM_TYPE_SHARED, key=world.Get_rank())
    try:
        return Seat(world.Get_rank(), world.Get_size(), local.Get_rank(), local.Get_size())
    finally:
        local.Free()


def _init_nccl(seat: Seat, world: Any) -> World:
    from trainer.comm.nccl.communicator import NcclCommunicator

    # Every rank learns whether every rank has a GPU before any rank enters NCCL's collective
    # init: a rank that failed alone would otherwise leave the others waiting forever.
    problem = _gpu_problem(seat)
    problems = [p for p in world.allgather(problem) if p is not None]
    if problems:
        what, where, why, fix = problems[0]
        raise BootstrapError(what, where, why, fix)
    torch.cuda.set_device(seat.local_rank)
    comm = recorded(NcclCommunicator.create(world, seat.local_rank, "world"), os.environ)
    return World(seat.rank, seat.size, seat.local_rank,
                 torch.device("cuda", seat.local_rank), comm, world, seat.local_size)


def _gpu_problem(seat: Seat) -> tuple[str, str, str, str] | None:
    where = f"rank {seat.rank}, LOCAL_RANK={seat.local_rank}"
    if not torch.cuda.is_available():
        return ("NCCL backend needs a GPU", where, "torch.cuda.is_available() is False",
                "Run with backend='mpi' (CPU), or install a CUDA build of torch on a GPU host")
    count = torch.cuda.device_count()
    if seat.local_rank >= count:
        return ("no GPU for this rank", where, f"only {count} GPU(s) are visible on this host",
                "Start at most one rank per GPU (--nproc-per-node), or check CUDA_VISIBLE_DEVICES")
    from trainer.comm.nccl.setup import import_nccl

    try:
        import_nccl()
    except BootstrapError as exc:
        return (exc.what, f"{where}: {exc.where}", exc.why, exc.fix)
    return None
