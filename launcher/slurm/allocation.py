"""Hosts and slots from the Slurm allocation dtrain runs in (pure: reads a mapping).

Used by `dtrain launch`/`check` when ``SLURM_JOB_ID`` and the node list are set and neither
--hostfile nor -H is given; outside an allocation nothing changes. Hosts are
``SLURM_JOB_NODELIST`` in order, expanded by `launcher.slurm.nodelist`. Slots per host, the
first of these that is set:

    SLURM_GPUS_ON_NODE     GPUs per node (--gpus-per-node, --gres=gpu:N)
    SLURM_JOB_GPUS         the GPUs' physical ids on the node the head runs on
                           (SLURMD_NODENAME; the only node of a one-node job), e.g. 2,3:
                           its ranks get CUDA_VISIBLE_DEVICES=2,3, or the ids the job sees
                           (below)
    SLURM_NTASKS_PER_NODE  --ntasks-per-node
    SLURM_TASKS_PER_NODE   the per-node task counts, e.g. 4(x2),2
    (none)                 1 slot per node

Every host's ``source`` says where its name and slots came from; `--dry-run` shows it.

With ``ConstrainDevices=yes`` (cgroup.conf) a job sees only its own GPUs, renumbered from 0:
physical GPUs 2,3 are CUDA devices 0,1 inside the job, and Slurm sets the batch script's
CUDA_VISIBLE_DEVICES=0,1 while SLURM_JOB_GPUS stays 2,3 (Slurm's gres guide, "GPU
Management"). So on the head's node the ids come from the CUDA_VISIBLE_DEVICES Slurm set when it
lists as many GPUs as SLURM_JOB_GPUS, and from SLURM_JOB_GPUS otherwise: right with and without
the constraint, for ranks started over SSH into the job's cgroup (pam_slurm_adopt) or as srun
steps (which get the job's GPUs on the node). Other nodes' ranks keep the CUDA_VISIBLE_DEVICES
of their srun step, which Slurm numbers the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from launcher.errors import HostfileError
from launcher.hosts.hostfile import HostEntry
from launcher.hosts.selection import HostSlots
from launcher.slurm.nodelist import expand_counts, expand_nodelist

JOB_ID = "SLURM_JOB_ID"


@dataclass(frozen=True)
class Allocation:
    """The allocation's hosts and, for the head's node, the GPUs' physical ids."""

    job_id: str
    entries: tuple[HostEntry, ...]
    gpu_ids: Mapping[str, tuple[int, ...]]   # host -> physical GPU ids, slot i -> ids[i]


def in_allocation(environ: Mapping[str, str]) -> bool:
    """A job id and its node list: a stray SLURM_JOB_ID alone changes nothing."""
    return bool(environ.get(JOB_ID)) and bool(
        environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST"))


def read_allocation(environ: Mapping[str, str]) -> Allocation:
    """The allocation described by ``environ``; HostfileError naming the variable if unusable."""
    job = environ[JOB_ID]
    var = "SLURM_JOB_NODELIST" if environ.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
    nodes = expand_nodelist(environ.get(var, ""), where=f"{var} of Slurm job {job}")
    slots, how = _slots(environ, nodes)
    ids, ids_from = _gpu_ids(environ, nodes)
    entries = []
    for node, count in zip(nodes, slots, strict=True):
        source = f"Slurm job {job} {var}={environ[var]}; {how}"
        if node in ids:
            count, source = len(ids[node]), f"{source}; GPU ids {ids_from}"
        entries.append(HostEntry(node, count, source=source))
    return Allocation(job, tuple(entries), ids)


def with_gpu_ids(selected: Sequence[HostSlots], alloc: Allocation) -> list[HostSlots]:
    """Slot i of a host with known ids becomes GPU ids[i] (CUDA_VISIBLE_DEVICES is set)."""
    out = []
    for host in selected:
        ids = alloc.gpu_ids.get(host.entry.name)
        out.append(host if ids is None else
                   replace(host, slots=tuple(ids[s] for s in host.slots), restricted=True))
    return out


def _slots(environ: Mapping[str, str], nodes: list[str]) -> tuple[list[int], str]:
    for var in ("SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE"):
        if environ.get(var):
            count = _number(environ[var], var)
            return [count] * len(nodes), f"slots {var}={count}"
    if environ.get("SLURM_JOB_GPUS"):
        count = len(_id_list(environ["SLURM_JOB_GPUS"]))
        return [count] * len(nodes), f"slots len(SLURM_JOB_GPUS)={count}"
    if environ.get("SLURM_TASKS_PER_NODE"):
        text = environ["SLURM_TASKS_PER_NODE"]
        counts = expand_counts(text, "SLURM_TASKS_PER_NODE")
        if len(counts) != len(nodes):
            raise HostfileError("Slurm variables disagree", "SLURM_TASKS_PER_NODE",
                                f"{text!r} gives {len(counts)} counts for {len(nodes)} nodes",
                                "pass --nproc-per-node")
        return counts, f"slots SLURM_TASKS_PER_NODE={text}"
    return [1] * len(nodes), "1 slot (no SLURM_GPUS_ON_NODE or task counts)"


def _gpu_ids(environ: Mapping[str, str],
             nodes: list[str]) -> tuple[dict[str, tuple[int, ...]], str]:
    """The GPU ids of the batch node (the head's node or a lone node) as the job sees them,
    and which variable they came from."""
    text = environ.get("SLURM_JOB_GPUS", "")
    here = environ.get("SLURMD_NODENAME") or (nodes[0] if len(set(nodes)) == 1 else None)
    if not text or here not in nodes:
        return {}, ""
    physical = _id_list(text)
    seen = environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if len(seen) == len(physical) and all(part.isdigit() for part in seen):
        return {here: tuple(map(int, seen))}, \
            f"CUDA_VISIBLE_DEVICES={','.join(seen)} (physical SLURM_JOB_GPUS={text})"
    return {here: physical}, "SLURM_JOB_GPUS"


def _id_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise HostfileError("unreadable GPU ids", "SLURM_JOB_GPUS", f"{text!r}",
                            "expected comma-separated numbers, e.g. 0,1,2,3") from None


def _number(text: str, var: str) -> int:
    head = text.split("(")[0].split(",")[0]   # "4(x2)" or "4,4": the first node's count
    if not head.isdigit() or int(head) < 1:
        raise HostfileError("unreadable slot count", var, f"{text!r}",
                            "expected a positive number; or pass --nproc-per-node")
    return int(head)
