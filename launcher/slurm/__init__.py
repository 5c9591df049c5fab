"""Slurm: the allocation's hosts, and per-host agents started by `srun` (--launcher slurm).

    nodelist    SLURM_JOB_NODELIST / SLURM_TASKS_PER_NODE expansion, as `scontrol` does (pure)
    allocation  hosts, slots and GPU ids from the SLURM_* variables, with their source (pure)
    srun        the agent as one `srun` job step per host: an AgentStream over srun's pipes
                (adapter)

Everything after the agents start is the SSH launcher's code path; see docs/design.md §5.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launcher.transport.connect import AgentStarter


def starter_for(launcher: str) -> AgentStarter | None:
    """What `transport.connect` starts agents with: srun steps for "slurm", else None (SSH or
    local). `srun` is imported only then: an SSH launch's start-up would pay ~10 ms for it."""
    if launcher != "slurm":
        return None
    from launcher.slurm import srun

    return srun.start_agents
