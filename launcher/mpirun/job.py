"""The `mpirun` row of the transport table: `dtrain launch --launcher mpirun` as one
mpiexec/mpirun command built from the same plan (`command`), run to its exit code."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from launcher.hosts.selection import HostSlots
from launcher.mpirun import command as mpirun
from launcher.plan.job import JobPlan, Rendezvous
from launcher.transport.connect import validate_remote_python

if TYPE_CHECKING:
    from launcher.launch import LaunchRequest


def run_job(req: LaunchRequest, plan: JobPlan, selected: Sequence[HostSlots]) -> int:
    """Build the command (print it with --dry-run) and run it; its exit code is the job's."""
    where = mpirun.addresses([s.entry for s in selected], req.master_addr)
    rendezvous = Rendezvous(where.master_addr, req.master_port or 29500)
    exe = mpirun.find_mpirun(req.mpirun)
    flavour = req.mpi_flavour or mpirun.detect_flavour(exe)
    cmd = mpirun.build_command(plan, rendezvous, mpirun=exe, flavour=flavour,
                               head_addr=where.head_addr,
                               python=validate_remote_python(req.remote_python))
    if req.dry_run:
        print(cmd.shown())
        if cmd.hostfile_text:
            print("# hostfile:\n" + cmd.hostfile_text, end="")
        return 0
    return mpirun.run_command(cmd, timeout=req.supervise.timeout, grace=req.supervise.grace)
