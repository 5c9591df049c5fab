"""`dtrain launch --dry-run`: the plan as a user reads it (hosts, ranks, each rank's env)."""

from __future__ import annotations

import shlex
from typing import TextIO

from rich.console import Console
from rich.table import Table

from launcher.plan.job import JobPlan
from workerenv import MASTER_ADDR, MASTER_PORT

AT_START_UP = "<chosen-at-start-up>"


def print_plan(plan: JobPlan, *, auto_master: tuple[bool, bool], out: TextIO) -> None:
    console = Console(file=out, highlight=False, markup=False, soft_wrap=True, width=160)
    console.print(f"job {plan.job_id}: {plan.world_size} ranks on {len(plan.hosts)} hosts",
                  markup=False)
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
    notes = []
    if auto_master[0]:
        notes.append("MASTER_ADDR is chosen at launch: rank 0's host address as routed from "
                     "the next host (127.0.0.1 for a single host)")
    if auto_master[1]:
        notes.append("MASTER_PORT is chosen at launch: a free port on rank 0's host")
    for note in notes:
        console.print(f"note: {note}")
    if plan.base_env:
        console.print("environment added to every rank:")
        for key in sorted(plan.base_env):
            console.print(f"  {key}={plan.base_env[key]}")
    console.print("per-rank environment (plus PMI_FD or PMI_PORT/PMI_ID set by the agent):")
    # A value picked at start-up is not known now; showing a placeholder value would mislead.
    later = {key for key, auto in zip((MASTER_ADDR, MASTER_PORT), auto_master, strict=True)
             if auto}
    for spec in plan.ranks:
        pairs = " ".join(f"{k}={AT_START_UP if k in later else v}"
                         for k, v in sorted(spec.env.items()))
        console.print(f"  rank {spec.rank}@{spec.host}: {pairs}")
