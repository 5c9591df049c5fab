"""`dtrain check`: a preflight table of every host, checked in parallel.

For each host: reachable and authenticated (with the connection latency), the agent starts
with the same Python and dtrain/torch/mpi4py versions as the head, the ranks' `python`
(resolved with the PATH a rank gets: the head's entries first, then the host's) is the same
path as on the head, slots fit the GPUs that `nvidia-smi` lists (when it is there), and the
working directory exists. A mismatched `python` names the head's VIRTUAL_ENV/CONDA_PREFIX when
it is missing on the host. Exit code 1 when any host has a problem, so scripts can gate a
launch on it.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table

from launcher import wire
from launcher.agent.facts import host_facts
from launcher.errors import DtrainError
from launcher.hosts.selection import HostSlots
from launcher.plan.environment import compose_base_env, program_env
from launcher.transport import table
from launcher.transport.connect import close_streams, start_agents
from launcher.transport.options import SSHOptions
from launcher.transport.stream import AgentStream

COMPARED = ("torch", "mpi4py", "mpich")


@dataclass
class HostCheck:
    host: str
    slots: int
    latency_ms: float | None = None
    facts: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def compare(head: dict[str, Any], remote: dict[str, Any], slots: int) -> list[str]:
    """What differs between the head and a host, as sentences a user can act on (pure)."""
    problems = []
    if remote.get("python") != head.get("python"):
        problems.append(f"python {remote.get('python')} (head {head.get('python')})")
    if remote.get("rank_python") != head.get("rank_python"):
        found = remote.get("rank_python") or "no python"
        problem = f"`python` runs {found} (head {head.get('rank_python')})"
        if remote.get("missing_prefixes"):
            problem += "; missing here: " + ", ".join(remote["missing_prefixes"])
        problems.append(problem)
    if remote.get("dtrain") != head.get("dtrain"):
        problems.append(f"dtrain {remote.get('dtrain')} (head {head.get('dtrain')})")
    for name in COMPARED:
        mine, theirs = head["versions"].get(name), remote.get("versions", {}).get(name)
        if mine != theirs:
            problems.append(f"{name} {theirs or 'missing'} (head {mine or 'missing'})")
    gpus = remote.get("gpus")
    if gpus is not None and slots > gpus:
        problems.append(f"{slots} slots but nvidia-smi lists {gpus} GPUs")
    if not remote.get("cwd_exists"):
        problems.append("working directory missing")
    return problems


def ask_facts(stream: AgentStream, cwd: str, timeout: float,
              planned: dict[str, str]) -> dict[str, Any]:
    """HELLO, one facts QUERY, BYE: a short synchronous conversation with an agent."""
    decoder = wire.Decoder()
    stream.write(wire.encode_json(wire.Kind.QUERY, {"op": "facts", "cwd": cwd, "env": planned}))
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            data = stream.read(65536)
            if not data:
                stderr = stream.stderr_text().strip()
                last = f": {stderr.splitlines()[-1]}" if stderr else ""
                raise RuntimeError("agent exited" + last)
            for frame in decoder.feed(data):
                if frame.kind is wire.Kind.REPLY:
                    return frame.json()
        raise RuntimeError(f"agent did not answer within {timeout}s")
    finally:
        stream.write(wire.encode_json(wire.Kind.BYE))
        stream.close()


def forwarded_to_ranks(cwd: str) -> dict[str, str]:
    """The variables that decide which `python` a rank runs, as `dtrain launch` would plan
    them (forwarded from the head, then .dtrainenv files)."""
    base = compose_base_env(os.environ, cwd=cwd)
    return program_env(base)


def check_hosts(selected: Sequence[HostSlots], *, ssh: SSHOptions, python: str,
                cwd: str, timeout: float = 60.0,
                via: table.Transport = table.get(table.DEFAULT_LAUNCHER)) -> list[HostCheck]:
    rows = {h.entry.name: HostCheck(h.entry.name, len(h.slots)) for h in selected}
    planned = forwarded_to_ranks(cwd)  # a bad .dtrainenv fails before anything starts
    streams: dict[str, AgentStream] = {}
    results = start_agents(selected, python=python, ssh=ssh, transport=via)
    for h, res in zip(selected, results, strict=True):
        if isinstance(res, DtrainError):
            rows[h.entry.name].problems.append(str(res))
            continue
        streams[h.entry.name] = res
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(streams) or 1)) as pool:
        futures = {name: pool.submit(ask_facts, s, cwd, timeout, planned)
                   for name, s in streams.items()}
    head = host_facts(cwd, planned)
    for name, fut in futures.items():
        try:
            facts = rows[name].facts = fut.result()
        except (OSError, RuntimeError, wire.WireError) as exc:
            rows[name].problems.append(f"agent failed: {exc}")
            continue
        connection = streams[name].connection  # read now: an srun step's counts to its HELLO
        rows[name].latency_ms = connection.latency_ms if connection else None
        rows[name].problems += compare(head, facts, rows[name].slots)
    close_streams(list(streams.values()))
    return list(rows.values())


def print_table(rows: Sequence[HostCheck], out: TextIO) -> None:
    console = Console(file=out, highlight=False, markup=False, soft_wrap=True, width=200)
    table = Table(title="dtrain check", title_justify="left")
    columns = ("host", "hostname", "ssh ms", "python", "`python` runs", "dtrain", *COMPARED,
               "slots/gpus", "result")
    for col in columns:
        table.add_column(col)
    for r in rows:
        f = r.facts or {}
        v = f.get("versions", {})
        gpus = f.get("gpus")
        table.add_row(r.host, f.get("hostname", "-"),
                      "local" if r.latency_ms is None and f else
                      (f"{r.latency_ms:.0f}" if r.latency_ms is not None else "-"),
                      f.get("python", "-"), f.get("rank_python") or "-", f.get("dtrain", "-"),
                      *[str(v.get(n) or "-") for n in COMPARED],
                      f"{r.slots}/{'-' if gpus is None else gpus}",
                      "ok" if r.ok else f"{len(r.problems)} problem(s), below")
    console.print(table)
    # Below the table, unwrapped: problems carry paths and commands a user copies.
    for r in rows:
        for problem in r.problems:
            console.print(f"{r.host}: {problem}")


def run_check(selected: Sequence[HostSlots], *, ssh: SSHOptions,
              python: str = sys.executable, cwd: str | None = None,
              via: table.Transport = table.get(table.DEFAULT_LAUNCHER)) -> int:
    rows = check_hosts(selected, ssh=ssh, python=python, cwd=cwd or os.getcwd(), via=via)
    print_table(rows, sys.stdout)
    bad = [r.host for r in rows if not r.ok]
    if bad:
        print(f"dtrain check: problems on {len(bad)} of {len(rows)} hosts: {', '.join(bad)}",
              file=sys.stderr)
        return 1
    return 0
