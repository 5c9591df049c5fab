"""Launch on 8-64 real namespace hosts x 1 rank: dtrain flat and tree vs Hydra and pdsh.

    python -m bench.hosts_scale [--hosts 8,16,32,64] [--reps 3] [--tools dtrain,hydra,...]

One cluster of network-namespace hosts (one sshd each, `testbed.netns`), built once; on the
first N hosts, one rank per host, in the same run (tool order rotated every repetition):

* ``dtrain``       `dtrain launch` flat (the head holds one SSH connection per host);
* ``dtrain-tree``  the same with ``--fanout K`` (relays start their subtree's agents); left
                   out with the reason when this dtrain has no --fanout; ``dtrain-tree:K``
                   with that K instead of ``fanout`` (``dtrain-tree:8`` is two levels at 64);
* ``dtrain-openssh`` flat with ``--ssh-client openssh`` (an ``ssh`` process per host, no
                   paramiko: not in the default tools);
* ``+eager``       after any dtrain tool: with ``--start eager`` (each host starts its ranks
                   once it and rank 0's host have checked the job, as Hydra's proxies start
                   theirs; ``dtrain+eager`` is in the default tools);
* ``hydra``        ``mpiexec.hydra -launcher ssh``;
* ``pdsh``         one remote shell per host (no PMI: it cannot form an MPI world, so it runs
                   the plain stamp program and has no world time).

The MPI tools run ``bench/workers/mpi_stamp.py`` (``from mpi4py import MPI``: MPI_Init over
the launcher's PMI, then a barrier). Per run, from t0 just before the launcher starts:
``running`` every rank's first stamp, ``world`` every rank past MPI_Init, ``wired`` = world
minus running (the MPI wire-up: mpi4py's import and MPI_Init, the PMI fence and every rank's
gets of its peers' cards, without the launch before it), ``exit`` the launcher returned,
``tail`` = exit minus the last rank's last stamp (MPI_Finalize, the process's end and the
launcher's teardown), and ``head CPU``: the CPU seconds of the launcher and every process it
started on this side (getrusage of the bench's children: dtrain's head, mpiexec and its ssh
clients, pdsh and its ssh clients; not the remote sides), and ``machine CPU``: every
process's CPU seconds on this machine over the run (/proc/stat), both sides of every host,
since namespace hosts share its cores: agents or proxies, sshd, the ranks. On 2 cores a run
this size is CPU-bound from start to end, so the world time follows this total (world ~
machine CPU / cores), and the difference between two tools' totals is what their
wire-up times differ by, in CPU.
Medians over the repetitions; ratios to Hydra (target <= 1.0 from 16 hosts; the tree no
slower than flat at 64).
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from bench import common, grid

HOSTS = (8, 16, 32, 64)
TOOLS = ("dtrain", "dtrain+eager", "dtrain-tree", "hydra", "pdsh")
PER_HOST = 1
FANOUT = 4
KEYS = ("running", "world", "wired", "exit", "tail", "cpu", "machine")
MPI_SCRIPT = common.WORKERS / "mpi_stamp.py"
PLAIN_SCRIPT = common.WORKERS / "stamp.py"
COLUMNS = [("tool", "tool"), ("hosts", "hosts"), ("ok", "ok"), ("running s", "running_s"),
           ("world s", "world_s"), ("wired s", "wired_s"), ("exit s", "exit_s"),
           ("tail s", "tail_s"), ("head CPU s", "cpu_s"), ("machine CPU s", "machine_s"),
           ("world/Hydra", "world_s_vs_hydra"),
           ("wired/Hydra", "wired_s_vs_hydra"), ("exit/Hydra", "exit_s_vs_hydra"),
           ("CPU/Hydra", "cpu_s_vs_hydra"), ("machine/Hydra", "machine_s_vs_hydra")]
SUMMARY_COLUMNS = COLUMNS
SUMMARY_NOTE = (
    "Namespace hosts share this machine's CPUs: N hosts start N sshd sessions and N Python "
    "ranks on the same cores, so times grow with N for every tool alike; compare the ratios. "
    "Head CPU counts the launcher and its local helper processes (ssh clients), not the "
    "remote side.")


def has_fanout() -> bool:
    """Whether this dtrain's `launch` takes --fanout (the tree launch of issue 39)."""
    out = subprocess.run([sys.executable, "-m", "launcher", "launch", "--help"],
                         capture_output=True, text=True, cwd=common.REPO, env=common.base_env())
    return "--fanout" in out.stdout


def _launch(cluster: Any, tool: str, n: int, per_host: int, out: str,
            fanout: int) -> common.Launch:
    if tool == "pdsh":
        return common.pdsh_launch(cluster, n, per_host, PLAIN_SCRIPT, out)
    tool, eager, _ = tool.partition("+eager")
    base = tool if tool in common.TOOLS else "dtrain"  # dtrain-tree[:K]: dtrain's launch
    launch: common.Launch = common.TOOLS[base](cluster, n, per_host, MPI_SCRIPT, out)
    extra = ["--start", "eager"] if eager else []
    if tool.startswith("dtrain-tree"):
        extra += ["--fanout", tool.partition(":")[2] or str(fanout)]
    if not extra:
        return launch
    at = launch.argv.index("--")  # dtrain's options go before its program
    return common.Launch([*launch.argv[:at], *extra, *launch.argv[at:]], launch.env)


def _metrics(t0: float, t_exit: float, stamps: list[dict]) -> dict[str, float]:
    last = max(s.get("barrier", s["start"]) for s in stamps)
    inits = [s["init"] for s in stamps if "init" in s]
    running = max(s["start"] for s in stamps)
    world = max(inits) if len(inits) == len(stamps) else float("nan")
    return {"running": running - t0, "world": world - t0, "wired": world - running,
            "exit": t_exit - t0, "tail": t_exit - last}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _machine_cpu() -> float:
    """CPU seconds every process on this machine has used since boot (/proc/stat's first line:
    every state but idle and iowait; guest time is already counted in user)."""
    with open("/proc/stat") as stat:
        ticks = [int(t) for t in stat.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def run_one(cluster: Any, tool: str, n: int, per_host: int, fanout: int) -> common.Sample:
    base = tool if tool in common.TOOLS else "dtrain"  # dtrain-tree[:K], ...+eager: dtrain
    missing = common.tool_missing(base)
    if missing:
        return common.Sample(None, missing)
    out_dir = tempfile.mkdtemp(prefix="dtrain-bench-stamps-")
    try:
        cpu0, machine0 = _children_cpu(), _machine_cpu()
        sample = common.time_launch(_launch(cluster, tool, n, per_host, out_dir, fanout),
                                    out_dir, n * per_host, _metrics, common.count_check, 180)
        cpu, machine = _children_cpu() - cpu0, _machine_cpu() - machine0
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    left = common.settle(cluster)
    if sample.metrics is None:
        return sample
    metrics = {**sample.metrics, "cpu": cpu, "machine": machine}
    if left:
        return common.Sample(metrics, f"processes left on hosts after exit: {left}")
    return common.Sample(metrics)


def run(hosts: Sequence[int] = HOSTS, reps: int = 3, *, tools: Sequence[str] = TOOLS,
        per_host: int = PER_HOST, fanout: int = FANOUT, warmup: bool = True, cluster: Any = None,
        progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Rows {tool, hosts, running_s, world_s, exit_s, tail_s, cpu_s (medians), ratios}."""
    tree = any(t.startswith("dtrain-tree") for t in tools) and has_fanout()
    chosen = [t for t in tools if not t.startswith("dtrain-tree") or tree]
    with common.bench_cluster(max(hosts), cluster) as used:
        results = common.collect(used, chosen, list(hosts), reps,
                                 lambda tool, n: run_one(used, tool, n, per_host, fanout),
                                 warmup, progress)
    rows = common.summarize("hosts_scale", results, per_host, KEYS)
    for row in rows:  # pdsh forms no MPI world
        for key in ("world", "wired"):
            if row[f"{key}_s"] is not None and row[f"{key}_s"] != row[f"{key}_s"]:
                row[f"{key}_s"] = row[f"{key}_min_s"] = None
    rows += [{"bench": "hosts_scale", "tool": tool, "hosts": n, "ok": 0, "reps": 0,
              "error": "this dtrain has no --fanout (the tree launch is not merged)"}
             for tool in tools if tool not in chosen for n in hosts]
    rows.sort(key=lambda r: (list(tools).index(r["tool"]), r["hosts"]))
    if "hydra" in chosen:
        for key in ("world_s", "wired_s", "exit_s", "cpu_s", "machine_s"):
            common.add_ratios(rows, key)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    common.print_rows(f"Launch on namespace hosts x {PER_HOST} rank: dtrain flat/tree, "
                      "mpiexec.hydra, pdsh", rows, COLUMNS)


def main(argv: Sequence[str] | None = None) -> int:
    return grid.main(argv, name="hosts_scale", doc=__doc__, hosts="8,16,32,64", tools=TOOLS,
                     per_host=PER_HOST, run=run, print_table=print_table)


if __name__ == "__main__":
    sys.exit(main())
