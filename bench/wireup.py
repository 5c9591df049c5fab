"""MPI wire-up: command start to a full world (every rank past MPI_Init), dtrain vs Hydra.

    python -m bench.wireup [--hosts 1,2,4,8] [--reps 5] [--per-host 4] [--json PATH]

Same cluster and protocol as `bench.launch_time`, with a rank program that does
``from mpi4py import MPI`` (MPI_Init, MPICH from the PyPI wheel) and a barrier
(``bench/workers/mpi_stamp.py``). dtrain serves PMI-1 from its per-host agents over the SSH
channel (``dtrain``: paramiko in the head; ``dtrain-openssh``: --ssh-client openssh);
``mpiexec.hydra -launcher ssh`` serves it from its ``hydra_pmi_proxy`` per host. Per run:
``world`` = last rank past MPI_Init - t0, ``barrier`` = last rank past the first barrier - t0,
``exit`` = launcher returned - t0, ``init`` = the longest ``import mpi4py.MPI`` inside one
rank (loading the library plus MPI_Init's PMI exchange; the launch itself excluded). A run
whose ranks do not see one world of the expected size counts as failed. Target: dtrain's
world time <= Hydra's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from bench import common, grid

HOSTS = (1, 2, 4, 8)
TOOLS = ("dtrain", "dtrain-openssh", "hydra")
PER_HOST = 4
SCRIPT = common.WORKERS / "mpi_stamp.py"
KEYS = ("world", "barrier", "exit", "init")
COLUMNS = [("tool", "tool"), ("hosts", "hosts"), ("ranks", "ranks"), ("ok", "ok"),
           ("world s", "world_s"), ("min", "world_min_s"), ("barrier s", "barrier_s"),
           ("exit s", "exit_s"), ("in-rank init s", "init_s"), ("world/Hydra", "world_s_vs_hydra"),
           ("init/Hydra", "init_s_vs_hydra"), ("world/1 host", "world_s_growth")]
SUMMARY_COLUMNS = COLUMNS
SUMMARY_NOTE = (
    "All namespace hosts share this one machine's CPUs and kernel: N hosts x 4 ranks start 4N "
    "Python processes on the same cores, so growth with the host count includes CPU contention "
    "that separate machines would not have. Each tool's runs are interleaved with the others' "
    "(tool order rotated every repetition), so contention and load from other work hit all "
    "tools alike; compare the ratios, not the absolute seconds.")


def metrics(t0: float, t_exit: float, stamps: list[dict]) -> dict[str, float]:
    return {"world": max(s["init"] for s in stamps) - t0,
            "barrier": max(s["barrier"] for s in stamps) - t0,
            "exit": t_exit - t0,
            "init": max(s["init"] - s["start"] for s in stamps)}


def one_world(stamps: list[dict], ranks: int) -> str | None:
    """None when the stamps show ranks 0..N-1 of one world of N; else what is wrong."""
    if len(stamps) != ranks:
        return f"{len(stamps)} of {ranks} ranks left a stamp"
    sizes = sorted({s["size"] for s in stamps})
    if sizes != [ranks]:
        return f"ranks saw world sizes {sizes}, expected {ranks} (no PMI reached them?)"
    if sorted(s["rank"] for s in stamps) != list(range(ranks)):
        return "MPI ranks are not 0..N-1 exactly once"
    return None


def run(hosts: Sequence[int] = HOSTS, reps: int = 5, *, tools: Sequence[str] = TOOLS,
        per_host: int = PER_HOST, warmup: bool = True, cluster: Any = None,
        progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Rows {tool, hosts, ranks, world_s, barrier_s, exit_s, init_s (medians), *_min_s, ...}.

    Builds a cluster of max(hosts) hosts unless ``cluster`` is given (then left open); raises
    `common.Skip` when network namespaces are unavailable.
    """
    with common.bench_cluster(max(hosts), cluster) as used:
        def one(tool: str, n: int) -> common.Sample:
            return common.run_one(used, tool, n, per_host, SCRIPT, metrics, one_world)

        results = common.collect(used, list(tools), list(hosts), reps, one, warmup, progress)
    rows = common.summarize("wireup", results, per_host, KEYS)
    rows.sort(key=lambda r: (tools.index(r["tool"]), r["hosts"]))
    if "hydra" in tools:
        for key in ("world_s", "init_s"):
            common.add_ratios(rows, key)
    common.add_growth(rows, "world_s")
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    common.print_rows(f"MPI wire-up over SSH: command start to every rank past MPI_Init, "
                      f"{common.describe(rows)} (dtrain, dtrain-openssh, mpiexec.hydra)",
                      rows, COLUMNS)


def main(argv: Sequence[str] | None = None) -> int:
    return grid.main(argv, name="wireup", doc=__doc__, hosts="1,2,4,8", tools=TOOLS,
                     per_host=PER_HOST, run=run, print_table=print_table)


if __name__ == "__main__":
    sys.exit(main())
