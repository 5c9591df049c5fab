"""The worker contract: the environment every rank started by `dtrain launch` receives.

This module is the one place the contract is written down. `launcher/` produces it and
`trainer/` consumes it; neither package imports the other, both import this module.

torchrun-compatible variables (an unmodified ``torch.distributed`` ``env://`` script runs):

    RANK              global rank, 0..WORLD_SIZE-1, filled host by host in hostfile order
    WORLD_SIZE        number of ranks in the job
    LOCAL_RANK        index of the rank on its host (also the GPU index within CUDA_VISIBLE_DEVICES)
    LOCAL_WORLD_SIZE  number of ranks on this host
    GROUP_RANK        index of this host in the job (torchrun's name); NODE_RANK is the same value
    NODE_RANK
    MASTER_ADDR       an address of rank 0's host that the other hosts can reach
    MASTER_PORT       a TCP port on MASTER_ADDR free for a rendezvous store

The rest of what a torchrun worker gets (`torch/distributed/elastic/agent/server/
local_elastic_agent.py`), so frameworks that look for torchrun take their torchrun path:
Lightning (`TorchElasticEnvironment`) and `torch.distributed.is_torchelastic_launched()` test
TORCHELASTIC_RUN_ID; without it Lightning picks its MPI mode whenever mpi4py sees a PMI world,
which ignores MASTER_ADDR and waits on rank 0's host name:

    TORCHELASTIC_RUN_ID         the job id (DTRAIN_JOB_ID)
    TORCHELASTIC_RESTART_COUNT  restarts of the job before this round: 0 for a first run (the
                                plan's ``restart_count``, set by the restart logic)
    TORCHELASTIC_MAX_RESTARTS   restarts the job may have (the plan's ``max_restarts``; 0)
    TORCHELASTIC_USE_AGENT_STORE
                                False: rank 0 serves the env:// store at MASTER_ADDR:MASTER_PORT
                                (True would make every rank a client of an agent's store)
    ROLE_RANK, ROLE_WORLD_SIZE  RANK and WORLD_SIZE (one role)
    ROLE_NAME                   default
    GROUP_WORLD_SIZE            the number of hosts
    TORCH_NCCL_ASYNC_ERROR_HANDLING
                                1 (a timed-out NCCL operation tears the process down) unless set

TORCHELASTIC_ERROR_FILE is left out: torchrun points it at a file its agent reads back after a
failure (`@record`); dtrain reports a failure from the rank's exit status and stderr.

MPICH wire-up (PMI-1, served through the per-host agent):

    PMI_FD            a socket inherited from the agent (default), or
    PMI_PORT, PMI_ID  a loopback port of the agent and this rank's one-time id
    PMI_RANK, PMI_SIZE

dtrain's own:

    DTRAIN_JOB_ID     identifies the job (log names, checkpoints, telemetry)
    DTRAIN_HOST       the host name as written in the hostfile
    DTRAIN_PROGRESS_FILE
                      where the rank keeps its progress record (below); set by the agent to a
                      file in a private per-job folder on the host's local disk (/dev/shm)
    OMP_NUM_THREADS   1 unless the user set it
    DTRAIN_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT
                      how many times the job was restarted (`--max-restarts`): 0 in its first
                      round; TORCHELASTIC_MAX_RESTARTS is the budget (torchrun's names, so
                      scripts written for torchrun behave the same)
    DTRAIN_RESTART_CAUSE
                      from the first restart on: what ended the round before, in a few words
                      (``host lost: node2``); the trainer prints it when it resumes
    DTRAIN_INITIAL_WORLD_SIZE
                      from the first restart on: WORLD_SIZE of the first round, so a program
                      can tell that hosts were left out (`--min-nodes`) and keep its batch
    DTRAIN_GRACE_S    seconds between the SIGTERM that stops a rank and the SIGKILL that
                      follows (`--grace`): the time a rank has to save a checkpoint
    CUDA_VISIBLE_DEVICES  only when --include/--exclude selected GPU slots on this host
    GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME
                      the network interface of this host that routes to MASTER_ADDR, unless
                      the user set them (gloo and NCCL otherwise guess from the host name or
                      take the first interface, often a bridge or docker0)

Forwarded from the head (launcher/plan/environment.py): variables whose names start with one
of FORWARDED_PREFIXES or are named in FORWARDED_NAMES, then .dtrainenv files and --env. Besides
the communication libraries' own (NCCL_, UCX_, FI_, GLOO_, MPICH_...), these are the settings the
common frameworks read from the environment, so a script written for another launcher sees the
head's: DeepSpeed DS_ (DS_ACCELERATOR=cpu picks its CPU accelerator; DeepSpeed's own launcher
forwards only its export list and .deepspeed_env), Accelerate ACCELERATE_, FSDP_, MEGATRON_LM_
and PARALLELISM_CONFIG_ (what `accelerate launch` would have set from its config), Lightning
PL_ (PL_GLOBAL_SEED...), Megatron-core and Transformer Engine NVTE_ and
PYTORCH_CUDA_ALLOC_CONF (PYTORCH_), NVIDIA_TF32_OVERRIDE, torch.compile TORCHINDUCTOR_,
TORCHDYNAMO_ and TRITON_, Hugging Face HF_, TRANSFORMERS_ and TOKENIZERS_. PATH is
merged rather than replaced: the head's entries first, then the host's own PATH entries that
are not already in it, so ``python`` (or any argv[0]) is the head's wherever the head's
virtualenv or conda prefix exists on the host, and the host's own otherwise. VIRTUAL_ENV,
CONDA_PREFIX and CONDA_DEFAULT_ENV travel with it for tools that read them.

Inherited PMI_*, PMIX_*, OMPI_*, SLURM_* variables are removed before the launcher adds its own,
because MPICH refuses to start when PMIX_* is set and a stale PMI_* would point at another job.

The progress record (`PROGRESS_FILE`): a fixed-size file the rank memory-maps and writes, and
the host's agent reads without the rank's help (hang diagnosis, live view, stragglers). Only
the rank writes it, so no lock is shared. In the host's native byte order (writer and reader
are always on one host); a 64-byte header (`PROGRESS_HEADER`: magic, pid, rank, last step,
`time.monotonic()` of its report, its compute seconds, their moving average, the first step
this process reported and when: a run resumed from a checkpoint at step S reports S+1 first,
which is how the launcher counts the steps a restart repeated) and
`PROGRESS_SLOTS` slots of `PROGRESS_SLOT_SIZE` bytes, one per communicator in creation order: a
fixed part written once (`PROGRESS_SLOT_ID`: group label such as ``dp[1]``, the rank's index in
the group, the group's size), the operation last entered (`PROGRESS_SLOT_OP`, one write per
operation: sequence number counted from 1, op code into `PROGRESS_OPS`, dtype code into
`PROGRESS_DTYPES`, p2p kind 0 none / 1 send / 2 recv, peer as a group rank or -1, bytes,
`time.monotonic()` of entry: CLOCK_MONOTONIC, shared by every process of the host and never
stepped), the number of operations completed (`PROGRESS_SLOT_DONE`, an 8-byte word at an
offset that is a multiple of 8, so the rank updates it with one store) and the last
`PROGRESS_HISTORY` operations entered (`PROGRESS_HISTORY_AT`: one aligned 8-byte word per
operation, operation ``seq`` at index ``seq % PROGRESS_HISTORY``: its op code in bits 0-7,
peer + 1 in bits 16-31 (0: none) and, from bit 32, the number of collectives entered on the
group so far, this one included).
Collectives must run in the same order on every member of a group, point-to-point operations
need not (a pipeline's inner stages send and receive where the outer ones do one of the two),
so the diagnosis lines collectives up by that count, not by the sequence number. A reader copies
the record until two copies agree (`read_progress`), so a torn write is never seen.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Mapping

from records import Record

RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
NODE_RANK = "NODE_RANK"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
PMI_FD = "PMI_FD"
PMI_PORT = "PMI_PORT"
PMI_ID = "PMI_ID"
PMI_RANK = "PMI_RANK"
PMI_SIZE = "PMI_SIZE"
JOB_ID = "DTRAIN_JOB_ID"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCHELASTIC_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
ROLE_RANK = "ROLE_RANK"
ROLE_NAME = "ROLE_NAME"
ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
TORCH_NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
HOST = "DTRAIN_HOST"
PROGRESS_FILE = "DTRAIN_PROGRESS_FILE"
OMP_NUM_THREADS = "OMP_NUM_THREADS"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
PATH = "PATH"
RESTART_COUNT = "DTRAIN_RESTART_COUNT"
RESTART_CAUSE = "DTRAIN_RESTART_CAUSE"
INITIAL_WORLD_SIZE = "DTRAIN_INITIAL_WORLD_SIZE"
GRACE_S = "DTRAIN_GRACE_S"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCHELASTIC_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"

#: Prefixes of inherited variables that belong to another launcher and are always removed.
SCRUBBED_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "SLURM_")

#: Prefixes of head-node variables forwarded to every rank (like DeepSpeed's export list).
FORWARDED_PREFIXES = (
    "NCCL_", "PYTHON", "CUDA_", "MPICH_", "MPIR_CVAR_", "TORCH_", "UCX_", "FI_", "HF_",
    "WANDB_", "MLFLOW_", "GLOO_", "OMP_", "MKL_", "LANG", "LC_", "TZ",
    # frameworks' settings (see above)
    "DS_", "ACCELERATE_", "FSDP_", "MEGATRON_LM_", "PARALLELISM_CONFIG_", "PL_", "NVTE_",
    "PYTORCH_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "TRITON_", "TRANSFORMERS_", "TOKENIZERS_",
)

#: Head-node variables forwarded by exact name: the programs and interpreter the head would run
#: (PATH is put in front of the host's own PATH, see above), and TF32 for Megatron-core.
FORWARDED_NAMES = (PATH, "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV",
                   "NVIDIA_TF32_OVERRIDE")

#: torchrun's variables equal on every rank of a job, which the plan sets (see above).
TORCHRUN_JOB_WIDE = (TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS,
                     TORCHELASTIC_USE_AGENT_STORE, ROLE_NAME, ROLE_WORLD_SIZE, GROUP_WORLD_SIZE,
                     TORCH_NCCL_ASYNC_ERROR_HANDLING)


class DtrainError(Exception):
    """Base of every error dtrain reports to a user, launcher and trainer alike: one message
    shape, ``<what failed> [<where>]: <why>. <how to fix>``, so a user can act on it without
    reading code; ``where`` is a ``path:line``, a host, a rank, an option or a file."""

    exit_code = 2

    def __init__(self, what: str, where: str, why: str, fix: str = "") -> None:
        self.what, self.where, self.why, self.fix = what, where, why, fix
        text = f"{what} [{where}]: {why}" if where else f"{what}: {why}"
        if fix:
            text += f". {fix}"
        super().__init__(text)


class ContractError(RuntimeError):
    """The environment does not hold the worker contract (the process was not started by dtrain)."""


class WorkerEnv(Record, frozen=True):
    """The contract as one rank sees it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    job_id: str
    host: str

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        """Read the contract; a missing or malformed variable names itself and the fix."""
        env = os.environ if environ is None else environ
        return cls(
            rank=_int(env, RANK),
            world_size=_int(env, WORLD_SIZE),
            local_rank=_int(env, LOCAL_RANK),
            local_world_size=_int(env, LOCAL_WORLD_SIZE),
            node_rank=_int(env, GROUP_RANK),
            master_addr=env.get(MASTER_ADDR, "127.0.0.1"),
            master_port=_int(env, MASTER_PORT, default="29500"),
            job_id=env.get(JOB_ID, "standalone"),
            host=env.get(HOST, "localhost"),
        )


def in_launched_job(environ: Mapping[str, str] | None = None) -> bool:
    """True when the process was started by a launcher that set RANK and WORLD_SIZE."""
    env = os.environ if environ is None else environ
    return RANK in env and WORLD_SIZE in env


#: Rank variables set by MPI launchers (MPICH Hydra, Open MPI), mapped onto the contract.
_MPI_RANK_VARS = {
    RANK: ("PMI_RANK", "OMPI_COMM_WORLD_RANK"),
    WORLD_SIZE: ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"),
    LOCAL_RANK: ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"),
    LOCAL_WORLD_SIZE: ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"),
}


def from_mpi_launcher(environ: Mapping[str, str]) -> dict[str, str]:
    """The contract variables derived from an MPI launcher's own (`dtrain launch --launcher
    mpirun`). The host index assumes block placement of equal counts: rank // local size."""
    found: dict[str, str] = {}
    for name, sources in _MPI_RANK_VARS.items():
        for source in sources:
            if source in environ:
                found[name] = environ[source]
                break
        else:
            raise ContractError(
                f"MPI launcher variables missing [{' or '.join(sources)}]: this program was "
                "not started by mpiexec/mpirun. Start it with `dtrain launch`")
    node = str(int(found[RANK]) // max(1, int(found[LOCAL_WORLD_SIZE])))
    found[GROUP_RANK] = found[NODE_RANK] = node
    found[ROLE_RANK] = found[RANK]
    return found


def _int(env: Mapping[str, str], name: str, default: str | None = None) -> int:
    raw = env.get(name, default)
    if raw is None:
        raise ContractError(
            f"worker environment incomplete [{name}]: the variable is not set. "
            "Start the program with `dtrain launch` (or torchrun), which sets it"
        )
    try:
        return int(raw)
    except ValueError:
        raise ContractError(
            f"worker environment malformed [{name}={raw!r}]: not an integer. "
            "Do not override the launcher's rank variables"
        ) from None


PROGRESS_MAGIC = b"DTPROG3\0"
PROGRESS_HEADER = struct.Struct("=8sIIqdddqd")    # 64 bytes
PROGRESS_SLOT_ID = struct.Struct("=24sii")        # 32 bytes at slot + 0
PROGRESS_SLOT_OP = struct.Struct("=QBBbxiQd")     # 32 bytes at slot + 32
PROGRESS_SLOT_DONE = struct.Struct("=Q")          # 8 bytes at slot + 64
PROGRESS_HISTORY = 16                             # 8-byte words at slot + 72
PROGRESS_DONE_AT = PROGRESS_SLOT_ID.size + PROGRESS_SLOT_OP.size  # in a slot; 8-aligned in file
PROGRESS_HISTORY_AT = PROGRESS_DONE_AT + PROGRESS_SLOT_DONE.size
PROGRESS_SLOT_SIZE = PROGRESS_HISTORY_AT + 8 * PROGRESS_HISTORY   # 200, a multiple of 8
PROGRESS_SLOTS = 32
PROGRESS_SIZE = PROGRESS_HEADER.size + PROGRESS_SLOTS * PROGRESS_SLOT_SIZE
PROGRESS_OPS = ("", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv",
                "batch_p2p", "all_to_all", "barrier", "split")
PROGRESS_DTYPES = ("", "float32", "float64", "float16", "bfloat16", "int64", "int32", "int8",
                   "uint8", "bool")
#: Operations matched pairwise rather than by every member in the same order.
PROGRESS_P2P_OPS = frozenset({"send", "recv", "batch_p2p"})


class GroupProgress(Record, frozen=True):
    """One communicator of a rank, as its progress record holds it."""

    label: str
    group_rank: int
    group_size: int
    seq: int          # operations entered (the last one's number)
    done: int         # operations completed; ``done < seq`` while one is in flight
    op: str
    dtype: str
    p2p: int          # 0 collective, 1 send, 2 recv (for batch_p2p: its first receive, if any)
    peer: int
    nbytes: int
    entered_at: float  # time.monotonic() on the rank's host
    # The last operations entered, oldest first, the last one included: (seq, op, peer as a
    # group rank or -1, collectives entered on the group up to it).
    history: tuple[tuple[int, str, int, int], ...] = ()


class RankProgress(Record, frozen=True):
    pid: int
    rank: int
    step: int
    step_at: float     # time.monotonic() on the rank's host; 0 before the first step
    compute_s: float
    compute_avg_s: float
    groups: tuple[GroupProgress, ...]
    first_step: int = 0      # the first step this process reported (0: none yet)
    first_step_at: float = 0.0


def read_progress(data: Callable[[], bytes]) -> RankProgress | None:
    """Decode a progress record; ``data`` returns a fresh copy of the file's bytes. None while
    the rank has not written its header yet. Retried until two copies agree (no torn slot)."""
    raw, again = data(), data()
    for _ in range(10):
        if raw == again:
            break
        raw, again = again, data()
    if len(raw) < PROGRESS_SIZE or raw[:8] != PROGRESS_MAGIC:
        return None
    _, pid, rank, step, step_at, compute, avg, first, first_at = PROGRESS_HEADER.unpack_from(raw)
    groups = []
    for i in range(PROGRESS_SLOTS):
        at = PROGRESS_HEADER.size + i * PROGRESS_SLOT_SIZE
        label, grank, gsize = PROGRESS_SLOT_ID.unpack_from(raw, at)
        if not label.strip(b"\0"):
            break
        seq, op, dtype, p2p, peer, nbytes, entered = PROGRESS_SLOT_OP.unpack_from(
            raw, at + PROGRESS_SLOT_ID.size)
        (done,) = PROGRESS_SLOT_DONE.unpack_from(raw, at + PROGRESS_DONE_AT)
        groups.append(GroupProgress(
            label.rstrip(b"\0").decode("utf-8", "replace"), grank, gsize, seq, done,
            _name(PROGRESS_OPS, op), _name(PROGRESS_DTYPES, dtype), p2p, peer, nbytes, entered,
            _history(raw, at + PROGRESS_HISTORY_AT, seq)))
    return RankProgress(pid, rank, step, step_at, compute, avg, tuple(groups), first, first_at)


def _history(raw: bytes, at: int, seq: int) -> tuple[tuple[int, str, int, int], ...]:
    entries = []
    for n in range(max(1, seq - PROGRESS_HISTORY + 1), seq + 1):
        (word,) = PROGRESS_SLOT_DONE.unpack_from(raw, at + 8 * (n % PROGRESS_HISTORY))
        entries.append((n, _name(PROGRESS_OPS, word & 0xFF), ((word >> 16) & 0xFFFF) - 1,
                        word >> 32))
    return tuple(entries)


def _name(names: tuple[str, ...], code: int) -> str:
    return names[code] if code < len(names) else f"#{code}"
