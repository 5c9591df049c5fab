"""Where a launch spends its start-up time, for this checkout and optionally another one.

    python -m bench.launch_breakdown [--hosts 1,4] [--reps 5] [--compare DIR] [--json PATH]

Per checkout (its own ``.venv``), measured in fresh interpreters, median of ``--reps``:

* ``python``: a bare interpreter of the venv starting and exiting (``-c pass``): what every
  process of the launch (head, each agent, each rank) pays before its first import;
* ``head imports``: ``import launcher.cli`` (what the head imports before it parses options);
* ``paramiko``: paramiko imported the way a launch imports it once a remote host is to be
  connected (`launcher.transport.connect.import_paramiko`; in a checkout without it,
  with invoke blocked, as such a head did);
* ``agent imports``: ``import launcher.agent.main`` (each host's agent, before its HELLO);
* then ``dtrain launch --timings`` on N namespace hosts x 4 ranks (`bench.launch_time`'s
  stamp program), once per SSH client the checkout has (paramiko; ``openssh`` where it has
  ``--ssh-client``): the head's own stamps since its first import (``connected``: every agent
  stream open, for openssh every `ssh` started; ``hello``/``ready``: the last agent's HELLO
  and READY; ``running``: every rank started), from the ranks' stamps command start to every
  rank running, the head's CPU time (its own and its `ssh` children's, user + system), and
  where the checkout reports them the slowest agent's own phases (``agent boot``: its imports
  until HELLO; ``agent check``: its SPEC; ``agent spawn``: starting its ranks after START).

``--compare DIR`` runs the same on another checkout (e.g. an older commit in a git worktree
with ``make install`` done), interleaved rep by rep, so both see the same machine load.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import common

# label -> (code run in a fresh interpreter, the module whose cumulative import time is read)
IMPORTS = {
    "head imports": ("import launcher.cli", "launcher.cli"),
    "paramiko": ("try:\n from launcher.transport.connect import import_paramiko\n"
                 "except ImportError:\n import sys; sys.modules['invoke'] = None; import paramiko\n"
                 "else:\n import_paramiko(allow_config_exec=False)", "paramiko"),
    "agent imports": ("import launcher.agent.main", "launcher.agent.main"),
}
STAMPS = ("connected", "hello", "ready", "running")
PER_HOST = 4
_TIMINGS = re.compile(r"dtrain: timings since start: (.*)")
_AGENTS = re.compile(r"dtrain: agents, slowest host per phase: (.*)")
AGENT_PHASES = ("boot", "check", "spawn")


def interpreter_s(python: str, repo: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run([python, "-c", "pass"], check=True, cwd=repo)
    return time.perf_counter() - t0


def import_s(python: str, repo: Path, code: str, module: str) -> float:
    """Cumulative import time of ``module`` while ``code`` runs in a fresh interpreter
    (-X importtime)."""
    done = subprocess.run([python, "-X", "importtime", "-c", code], check=True,
                          cwd=repo, capture_output=True, text=True)
    for line in reversed(done.stderr.splitlines()):
        fields = [f.strip() for f in line.split("|")]
        if len(fields) == 3 and fields[2] == module:
            return int(fields[1]) / 1e6
    raise RuntimeError(f"no import time for {module} in {python}")


def clients(repo: Path) -> list[str]:
    """The SSH clients a checkout can launch with."""
    has_openssh = (repo / "launcher" / "transport" / "openssh").is_dir()
    return ["paramiko", "openssh"] if has_openssh else ["paramiko"]


def launch_once(cluster: Any, repo: Path, n_hosts: int,
                client: str = "paramiko") -> dict[str, float]:
    """One `dtrain launch --timings` of the stamp program; the head's stamps, the start and
    the head's CPU seconds (with its children: the `ssh` processes)."""
    python, out = str(repo / ".venv" / "bin" / "python"), Path(tempfile.mkdtemp())
    chosen = ["--ssh-client", client] if client != "paramiko" else []
    argv = [str(repo / ".venv" / "bin" / "dtrain"), "launch", "--timings", *chosen,
            "-H", common.host_list(n_hosts, PER_HOST), "--ssh-config",
            str(cluster.ssh_config), "--", python, str(common.WORKERS / "stamp.py"), str(out)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    done = subprocess.run(argv, cwd=repo, capture_output=True, text=True, timeout=120,
                          env={**common.base_env(), "PYTHONPATH": str(repo)})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"dtrain launch failed ({done.returncode}): {done.stderr[-500:]}")
    stamps = [json.loads(p.read_text()) for p in out.glob("*.json")]
    shutil.rmtree(out, ignore_errors=True)
    common.settle(cluster)
    found = _TIMINGS.search(done.stderr)
    head = dict(re.findall(r"(\w+) ([0-9.]+)s", found.group(1))) if found else {}
    row = {k: float(v) for k, v in head.items() if k in STAMPS}
    if found := _AGENTS.search(done.stderr):  # the slowest agent's own phases
        agents = dict(re.findall(r"(\w+) ([0-9.]+)s", found.group(1)))
        row.update({f"agent {k}": float(v) for k, v in agents.items() if k in AGENT_PHASES})
    row["every rank running"] = max(s["start"] for s in stamps) - t0
    row["head CPU"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return row


def run(hosts: Sequence[int] = (1, 4), reps: int = 5, compare: Path | None = None
        ) -> list[dict[str, Any]]:
    """Rows {checkout, measure, median_s}; raises `common.Skip` without network namespaces."""
    repos = {"this": common.REPO}
    if compare is not None:
        repos = {"compared": compare.resolve(), "this": common.REPO}
    samples: dict[tuple[str, str], list[float]] = {}

    def add(name: str, key: str, value: float) -> None:
        samples.setdefault((name, key), []).append(value)

    with common.bench_cluster(max(hosts)) as cluster:
        for repo in repos.values():  # warm-up: page cache, .pyc files, sshd's first fork
            for client in clients(repo):
                launch_once(cluster, repo, max(hosts), client)
        for _ in range(reps):
            for name, repo in repos.items():
                python = str(repo / ".venv" / "bin" / "python")
                add(name, "python", interpreter_s(python, repo))
                for label, (code, module) in IMPORTS.items():
                    add(name, label, import_s(python, repo, code, module))
                for n, client in itertools.product(hosts, clients(repo)):
                    for key, value in launch_once(cluster, repo, n, client).items():
                        add(name, f"{n} hosts, {client}: {key}", value)
    return [{"checkout": name, "measure": key, "median_s": statistics.median(values)}
            for (name, key), values in samples.items()]


def print_table(rows: list[dict[str, Any]]) -> None:
    names = list(dict.fromkeys(r["checkout"] for r in rows))
    keys = list(dict.fromkeys(r["measure"] for r in rows))
    value = {(r["checkout"], r["measure"]): r["median_s"] for r in rows}
    header = "| measure | " + " | ".join(f"{n} s" for n in names)
    print(header + (" | ratio |" if len(names) == 2 else " |"))
    print("|---" * (len(names) + 1 + (len(names) == 2)) + "|")
    for key in keys:
        cells = [value.get((n, key)) for n in names]
        line = f"| {key} | " + " | ".join(f"{c:.3f}" if c is not None else "-" for c in cells)
        if len(names) == 2 and all(cells):
            line += f" | {cells[1] / cells[0]:.2f}"  # type: ignore[operator]
        print(line + " |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.launch_breakdown", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", default="1,4", help="host counts, e.g. 1,4")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compare", type=Path, help="another checkout with its own .venv")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    try:
        rows = run([int(n) for n in args.hosts.split(",")], args.reps, args.compare)
    except common.Skip as why:
        print(f"launch_breakdown skipped: {why}", file=sys.stderr)
        return 0
    return common.report(rows, print_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
