"""The job plan: every rank's host, global/node/local rank and contract environment.

Ranks are filled host by host in hostfile order (block mapping, like Hydra's and DeepSpeed's):
host 0 gets ranks 0..n0-1, host 1 the next n1, and so on. LOCAL_RANK is the rank's index on its
host; when a filter chose specific GPUs the host gets CUDA_VISIBLE_DEVICES=<those slots> and
LOCAL_RANK indexes into that list, so `torch.cuda.set_device(LOCAL_RANK)` is always right.

PMI_FD / PMI_PORT / PMI_ID are not planned here: the per-host agent creates those sockets.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

import workerenv as we
from launcher.errors import UsageError
from launcher.hosts.hostfile import HostEntry
from launcher.hosts.selection import HostSlots

_JOB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class RankSpec:
    """One rank: where it runs and the contract variables it receives."""

    rank: int
    local_rank: int
    node_rank: int
    host: str
    env: Mapping[str, str]   # contract variables for this rank (see workerenv.py)


@dataclass(frozen=True)
class HostPlan:
    """One host and its ranks, in local-rank order."""

    entry: HostEntry
    node_rank: int
    ranks: tuple[RankSpec, ...]
    cuda_visible_devices: str | None


@dataclass(frozen=True)
class Rendezvous:
    """MASTER_ADDR and MASTER_PORT: where rank 0 listens for env:// rendezvous. Unlike the rest
    of the plan it is known only at start-up (rank 0's host picks the address towards the next
    host and a free port), unless --master-addr/--master-port fix it; START carries it."""

    addr: str
    port: int

    def __post_init__(self) -> None:
        if not self.addr or any(c.isspace() or c == "\0" for c in self.addr):
            raise UsageError("bad master address", "MASTER_ADDR", f"{self.addr!r} is not an "
                             "address", "Give a host name or IP that every host can reach")
        if isinstance(self.port, bool) or not 1 <= self.port <= 65535:
            raise UsageError("bad master port", "MASTER_PORT", f"{self.port!r} is not a TCP "
                             "port", "Give a free port in 1..65535")

    def env(self) -> dict[str, str]:
        return {we.MASTER_ADDR: self.addr, we.MASTER_PORT: str(self.port)}


@dataclass(frozen=True)
class RoundInfo:
    """Which round of a job the plan is for (`launcher.restart`): the restart variables."""

    number: int = 0
    """How many times the job was restarted before this round."""
    max_restarts: int = 0
    """--max-restarts, the budget."""
    cause: str = ""
    """What ended the round before (rounds after the first)."""
    initial_world: int = 0
    """WORLD_SIZE of the first round (rounds after the first)."""

    def env(self) -> dict[str, str]:
        out = {we.RESTART_COUNT: str(self.number),
               we.TORCHELASTIC_RESTART_COUNT: str(self.number),
               we.TORCHELASTIC_MAX_RESTARTS: str(self.max_restarts)}
        if self.number:
            out[we.RESTART_CAUSE] = self.cause
            out[we.INITIAL_WORLD_SIZE] = str(self.initial_world)
        return out


@dataclass(frozen=True)
class JobPlan:
    """Everything needed to start the job; the same plan drives the agents and `mpirun`."""

    job_id: str
    hosts: tuple[HostPlan, ...]
    world_size: int
    argv: tuple[str, ...]
    cwd: str
    base_env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    restart: RoundInfo = RoundInfo()
    """The round of the job this plan is for: the one source of the restart variables
    (DTRAIN_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS)."""

    @property
    def round(self) -> int:
        """The restart count of the round this plan is for (0: the first)."""
        return self.restart.number

    @property
    def kvsname(self) -> str:
        """The PMI key-value space, also the prefix of MPICH's shared-memory segments: one per
        round, so a later round never meets what a killed rank of an earlier one left."""
        return self.job_id if not self.round else f"{self.job_id}-r{self.round}"

    def rank_env(self, spec: RankSpec, rendezvous: Rendezvous | None = None) -> dict[str, str]:
        """The rank's full added environment: base_env, then the contract on top, with
        MASTER_ADDR/MASTER_PORT once the rendezvous is known."""
        return {**self.base_env, **spec.env, **(rendezvous.env() if rendezvous else {})}

    def job_env(self) -> dict[str, str]:
        """The contract variables equal on every rank (what `--launcher mpirun` sets once)."""
        first = self.ranks[0].env
        shared = (we.WORLD_SIZE, we.JOB_ID, we.OMP_NUM_THREADS, *we.TORCHRUN_JOB_WIDE)
        return {**{k: first[k] for k in shared if k in first}, **self.restart.env()}

    @property
    def ranks(self) -> tuple[RankSpec, ...]:
        """Every rank in global-rank order."""
        return tuple(spec for host in self.hosts for spec in host.ranks)

    @cached_property
    def process_mapping(self) -> str:
        """The PMI_process_mapping value MPICH asks the PMI server for (made once: every
        host's SPEC carries it, and making it walks every host)."""
        return process_mapping([len(host.ranks) for host in self.hosts])


def make_plan(selected: list[HostSlots], *, argv: Sequence[str], cwd: str, job_id: str,
              base_env: Mapping[str, str], restart: RoundInfo = RoundInfo(),
              grace: float | None = None) -> JobPlan:
    """Place ranks on the selected hosts and write each rank's contract variables (all but
    the `Rendezvous`, which start-up decides); ``restart`` says which round of the job this
    is, ``grace`` the --grace the ranks get to stop."""
    _check_inputs(selected, argv, cwd, job_id, base_env)
    world_size = sum(len(host.slots) for host in selected)
    shared = {we.WORLD_SIZE: str(world_size), we.PMI_SIZE: str(world_size), we.JOB_ID: job_id,
              # torchrun's (workerenv): frameworks that test for torchrun take its path
              we.TORCHELASTIC_RUN_ID: job_id, we.TORCHELASTIC_USE_AGENT_STORE: "False",
              we.ROLE_NAME: "default", we.ROLE_WORLD_SIZE: str(world_size),
              we.GROUP_WORLD_SIZE: str(len(selected)), **restart.env()}
    if grace is not None:
        shared[we.GRACE_S] = f"{grace:g}"
    if we.OMP_NUM_THREADS not in base_env:  # one thread per rank unless the user chose
        shared[we.OMP_NUM_THREADS] = "1"
    if we.TORCH_NCCL_ASYNC_ERROR_HANDLING not in base_env:  # torchrun's default
        shared[we.TORCH_NCCL_ASYNC_ERROR_HANDLING] = "1"
    hosts, next_rank = [], 0
    for node_rank, host in enumerate(selected):
        hosts.append(_host_plan(host, node_rank, next_rank, shared))
        next_rank += len(host.slots)
    return JobPlan(job_id=job_id, hosts=tuple(hosts), world_size=world_size, argv=tuple(argv),
                   cwd=cwd, base_env=MappingProxyType(dict(base_env)), restart=restart)


def new_job_id() -> str:
    """A job id that sorts by start time (UTC) and is unique: `20251122-023900-1a2b3c`."""
    # os.urandom is what `secrets` reads; importing `secrets` (hmac, hashlib) costs the head ~10 ms
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + os.urandom(3).hex()


def process_mapping(ranks_per_host: Sequence[int]) -> str:
    """MPICH's PMI_process_mapping for block mapping (`src/mpl/src/mpl_rankmap.c`).

    Format: `(vector,(start_node,num_nodes,ranks_per_node)...)`, one triple per run of hosts
    with equal rank counts: 2 hosts x 8 -> `(vector,(0,2,8))`; [2, 2, 1] ->
    `(vector,(0,2,2),(2,1,1))`. Hydra leaves the key out above 1024 characters; that choice
    belongs to the PMI server, which can check len() of this value.
    """
    counts = list(ranks_per_host)
    if not counts or any(not isinstance(n, int) or n < 1 for n in counts):
        raise ValueError(f"process_mapping needs positive rank counts, got {counts!r}")
    blocks, start = [], 0
    while start < len(counts):
        end = start
        while end < len(counts) and counts[end] == counts[start]:
            end += 1
        blocks.append(f"({start},{end - start},{counts[start]})")
        start = end
    return "(vector," + ",".join(blocks) + ")"


def _host_plan(host: HostSlots, node_rank: int, first_rank: int,
               shared: Mapping[str, str]) -> HostPlan:
    entry, count = host.entry, len(host.slots)
    # An unrestricted host always uses slots 0..n-1, where LOCAL_RANK is the GPU index already;
    # anything else needs CUDA_VISIBLE_DEVICES to make LOCAL_RANK index the chosen GPUs.
    natural = host.slots == tuple(range(count))
    visible = None if natural and not host.restricted else ",".join(map(str, host.slots))
    ranks = []
    for local_rank in range(count):
        rank = first_rank + local_rank
        env = dict(shared)
        env.update({
            we.RANK: str(rank), we.PMI_RANK: str(rank), we.ROLE_RANK: str(rank),
            we.LOCAL_RANK: str(local_rank),
            we.LOCAL_WORLD_SIZE: str(count), we.GROUP_RANK: str(node_rank),
            we.NODE_RANK: str(node_rank), we.HOST: entry.name,
        })
        if visible is not None:
            env[we.CUDA_VISIBLE_DEVICES] = visible
        ranks.append(RankSpec(rank, local_rank, node_rank, entry.name, MappingProxyType(env)))
    return HostPlan(entry, node_rank, tuple(ranks), visible)


def _check_inputs(selected: list[HostSlots], argv: Sequence[str], cwd: str, job_id: str,
                  base_env: Mapping[str, str]) -> None:
    if not selected or any(not host.slots for host in selected):
        raise UsageError("nothing to run on", "hosts", "no host with a slot was selected",
                         "Check the hostfile and --include/--exclude")
    if not argv:
        raise UsageError("no program given", "launch", "the command after `--` is empty",
                         "Write e.g. dtrain launch -- python train.py")
    for index, arg in enumerate(argv):
        if "\0" in arg:
            raise UsageError("NUL byte in argument", f"argv[{index}]", "a program argument "
                             "cannot contain NUL", "Remove it")
    if not cwd.startswith("/") or "\0" in cwd:
        raise UsageError("bad working directory", "cwd", f"{cwd!r} is not an absolute path",
                         "Give an absolute directory that exists on every host")
    if not _JOB_ID_RE.match(job_id):
        raise UsageError("bad job id", "job id", f"{job_id!r} is not 1-64 letters, digits, "
                         "'.', '-', '_'", "It names log files; choose a plain one")
    for name, value in base_env.items():
        if not _ENV_NAME_RE.match(name) or "\0" in value:
            raise UsageError("bad environment variable", name, "the name is not an "
                             "identifier or the value holds NUL", "Fix the --env/.dtrainenv entry")
