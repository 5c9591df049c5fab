"""`dtrain launch --dry-run`: the plan as a user reads it (hosts, ranks, each rank's env).

The `program ... on each host` lines say which executable each host will run. A local host
runs what the head's own lookup finds (its agent inherits the head's environment). A remote
host looks argv[0] up in the rank's PATH, the head's entries first, then its own
(`environment.rank_environment`); without connecting, the dry run can only show what the
head's entries give ("X if present there") and leaves the rest to `dtrain check`, which
resolves `python` on every host.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from typing import TextIO

from rich.console import Console
from rich.table import Table

import workerenv as we
from launcher.agent.ranks import find_program
from launcher.hosts.hostfile import HostEntry
from launcher.plan.environment import rank_environment
from launcher.plan.job import JobPlan
from workerenv import MASTER_ADDR, MASTER_PORT

AT_START_UP = "<chosen-at-start-up>"


def program_column(plan: JobPlan, entry: HostEntry, head_environ: Mapping[str, str]) -> str:
    """The executable ``entry`` will run for argv[0], as far as the head can know it."""
    argv0 = plan.argv[0]
    if entry.is_local or os.sep in argv0:
        found = find_program(argv0, rank_environment(head_environ, plan.base_env), plan.cwd)
        return found or "not found"
    planned = plan.base_env.get(we.PATH)
    found = find_program(argv0, {we.PATH: planned}, plan.cwd) if planned else None
    return f"{found} if present there, else the host's PATH" if found else "the host's PATH"


def print_plan(plan: JobPlan, *, master: tuple[str | None, int | None], out: TextIO,
               head_environ: Mapping[str, str] | None = None) -> None:
    """The plan as the agents will get it; ``master`` is --master-addr/--master-port (None:
    chosen at start-up, shown as such rather than as a value that would mislead)."""
    head_environ = os.environ if head_environ is None else head_environ
    console = Console(file=out, highlight=False, markup=False, soft_wrap=True, width=160)
    n_ranks = "1 rank" if plan.world_size == 1 else f"{plan.world_size} ranks"
    n_hosts = "1 host" if len(plan.hosts) == 1 else f"{len(plan.hosts)} hosts"
    console.print(f"job {plan.job_id}: {n_ranks} on {n_hosts}", markup=False)
    console.print(f"command: {shlex.join(plan.argv)}")
    console.print(f"cwd: {plan.cwd}")
    hosts = Table(title="hosts", title_justify="left")
    for col in ("node", "host", "user", "port", "ranks", "CUDA_VISIBLE_DEVICES", "from"):
        hosts.add_column(col)
    for hp in plan.hosts:
        e = hp.entry
        first, last = hp.ranks[0].rank, hp.ranks[-1].rank
        hosts.add_row(str(hp.node_rank), e.name, e.user or "-", str(e.port or "-"),
                      f"{first}-{last}" if last > first else str(first),
                      hp.cuda_visible_devices or "-", e.source or "-")
    console.print(hosts)
    console.print(f"program {plan.argv[0]!r} on each host:")
    for hp in plan.hosts:
        console.print(f"  {hp.entry.name}: {program_column(plan, hp.entry, head_environ)}")
    notes = []
    auto_master = (master[0] is None, master[1] is None)
    if auto_master[0]:
        notes.append("MASTER_ADDR is chosen at launch: rank 0's host address as routed from "
                     "the next host (127.0.0.1 for a single host)")
    if auto_master[1]:
        notes.append("MASTER_PORT is chosen at launch: a free port on rank 0's host")
    if any(not hp.entry.is_local for hp in plan.hosts) and os.sep not in plan.argv[0]:
        notes.append(f"remote hosts look {plan.argv[0]!r} up in the head's PATH entries, then "
                     "their own PATH; `dtrain check` shows which `python` each host runs")
    for note in notes:
        console.print(f"note: {note}")
    if plan.base_env:
        console.print("environment added to every rank:")
        for key in sorted(plan.base_env):
            console.print(f"  {key}={plan.base_env[key]}")
    console.print("per-rank environment (plus PMI_FD or PMI_PORT/PMI_ID set by the agent):")
    rendezvous = {MASTER_ADDR: AT_START_UP if master[0] is None else master[0],
                  MASTER_PORT: AT_START_UP if master[1] is None else str(master[1])}
    for spec in plan.ranks:
        pairs = " ".join(f"{k}={v}" for k, v in sorted({**spec.env, **rendezvous}.items()))
        console.print(f"  rank {spec.rank}@{spec.host}: {pairs}")
