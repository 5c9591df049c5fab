"""Launch time: command start to every rank running, and to the launcher's exit.

    python -m bench.launch_time [--hosts 1,2,4,8] [--reps 5] [--per-host 4] [--json PATH]

One cluster of network-namespace hosts (one sshd each, `testbed.netns`) is built once;
on the first N hosts x 4 ranks four launchers start the same rank program
(``bench/workers/stamp.py``, no MPI: it stamps ``time.time()`` first thing and exits 0):

* ``dtrain``  ``dtrain launch -H node1:4,... --ssh-config CFG -- python stamp.py DIR``
              (paramiko in the head);
* ``dtrain-openssh``  the same with ``--ssh-client openssh`` (one `ssh` process per host);
* ``hydra``   ``mpiexec.hydra -launcher ssh -hosts node1:4,... -n 4N`` (the MPICH wheel's);
* ``pdsh``    ``pdsh -w node1,...`` running ``for i in 0 1 2 3; do python stamp.py DIR $i &
              done; wait`` on every host (DeepSpeed's pdsh mode without its per-host launcher).

All of them use the same ssh_config, keys and known_hosts. Per run: ``start`` = last rank's
stamp - t0 (every rank running), ``first`` = first rank's stamp - t0, ``exit`` = launcher
returned - t0, with t0 taken just before ``Popen``. Tables show the median and the minimum
over the repetitions, dtrain/Hydra ratios of the medians (target <= 1) and each tool's growth
over its 1-host time (target: flat).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from bench import common, grid

HOSTS = (1, 2, 4, 8)
TOOLS = ("dtrain", "dtrain-openssh", "hydra", "pdsh")
PER_HOST = 4
SCRIPT = common.WORKERS / "stamp.py"
KEYS = ("start", "first", "exit")
COLUMNS = [("tool", "tool"), ("hosts", "hosts"), ("ranks", "ranks"), ("ok", "ok"),
           ("running s", "start_s"), ("min", "start_min_s"), ("first s", "first_s"),
           ("exit s", "exit_s"), ("min", "exit_min_s"), ("running/Hydra", "start_s_vs_hydra"),
           ("exit/Hydra", "exit_s_vs_hydra"), ("running/1 host", "start_s_growth")]
SUMMARY_COLUMNS = COLUMNS
SUMMARY_NOTE = (
    "All namespace hosts share this one machine's CPUs and kernel: N hosts x 4 ranks start 4N "
    "Python processes on the same cores, so growth with the host count includes CPU contention "
    "that separate machines would not have. Each tool's runs are interleaved with the others' "
    "(tool order rotated every repetition), so contention and load from other work hit all "
    "tools alike; compare the ratios, not the absolute seconds.")


def metrics(t0: float, t_exit: float, stamps: list[dict]) -> dict[str, float]:
    starts = [s["start"] for s in stamps]
    return {"start": max(starts) - t0, "first": min(starts) - t0, "exit": t_exit - t0}


def run(hosts: Sequence[int] = HOSTS, reps: int = 5, *, tools: Sequence[str] = TOOLS,
        per_host: int = PER_HOST, warmup: bool = True, cluster: Any = None,
        progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Rows {tool, hosts, ranks, start_s, first_s, exit_s (medians), *_min_s, ratios, ...}.

    Builds a cluster of max(hosts) hosts unless ``cluster`` is given (then left open); raises
    `common.Skip` when network namespaces are unavailable.
    """
    with common.bench_cluster(max(hosts), cluster) as used:
        def one(tool: str, n: int) -> common.Sample:
            return common.run_one(used, tool, n, per_host, SCRIPT, metrics)

        results = common.collect(used, list(tools), list(hosts), reps, one, warmup, progress)
    rows = common.summarize("launch_time", results, per_host, KEYS)
    rows.sort(key=lambda r: (tools.index(r["tool"]), r["hosts"]))
    for key in ("start_s", "exit_s"):
        if "hydra" in tools:
            common.add_ratios(rows, key)
    common.add_growth(rows, "start_s")
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    common.print_rows(f"Launch time over SSH: command start to every rank running and to exit, "
                      f"{common.describe(rows)} (dtrain, dtrain-openssh, mpiexec.hydra, pdsh)",
                      rows, COLUMNS)


def main(argv: Sequence[str] | None = None) -> int:
    return grid.main(argv, name="launch_time", doc=__doc__, hosts="1,2,4,8", tools=TOOLS,
                     per_host=PER_HOST, run=run, print_table=print_table)


if __name__ == "__main__":
    sys.exit(main())
