"""Slurm: the allocation's hosts, and per-host agents started by `srun` (--launcher slurm).

    nodelist    SLURM_JOB_NODELIST / SLURM_TASKS_PER_NODE expansion, as `scontrol` does (pure)
    allocation  hosts, slots and GPU ids from the SLURM_* variables, with their source (pure)
    srun        the agent as one `srun` job step per host: an AgentStream over srun's pipes
                (adapter)

Everything after the agents start is the SSH launcher's code path; see docs/design.md §5.
The `slurm` row of `launcher.transport.table` names srun's entry points.
"""
