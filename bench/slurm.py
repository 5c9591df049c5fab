"""Launch time under Slurm: command start to every rank running, dtrain vs bare srun.

    python -m bench.slurm [--hosts 1,2,4] [--reps 5] [--per-host 4] [--json PATH]

One real Slurm (`testbed.slurm`: slurmctld, munged, one slurmd per network-namespace host,
each host also running sshd) is built once. On N nodes x 4 ranks, every tool runs as the
command of its own ``salloc --nodes=N --ntasks-per-node=4``, so each pays for one allocation:

* ``dtrain-slurm``  ``dtrain launch --launcher slurm -- python stamp.py DIR`` (one srun step
                    per node runs dtrain's agent, which starts the node's 4 ranks);
* ``srun``          ``srun --mpi=none python stamp.py DIR`` (Slurm starts the 4N ranks itself);
* ``dtrain-ssh``    ``dtrain launch --ssh-config CFG -- python stamp.py DIR`` (hosts and slots
                    from the allocation, agents over SSH).

``start`` = last rank's stamp - t0 (every rank running), ``exit`` = salloc returned - t0, t0
taken just before ``Popen``; medians and minima over the repetitions, each tool's median over
srun's (target: dtrain-slurm within 1.2x of srun).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from bench import common, grid

HOSTS = (1, 2, 4)
TOOLS = ("dtrain-slurm", "srun", "dtrain-ssh")
PER_HOST = 4
SCRIPT = common.WORKERS / "stamp.py"
KEYS = ("start", "exit")
COLUMNS = [("tool", "tool"), ("nodes", "hosts"), ("ranks", "ranks"), ("ok", "ok"),
           ("running s", "start_s"), ("min", "start_min_s"), ("exit s", "exit_s"),
           ("min", "exit_min_s"), ("running/srun", "start_s_vs_srun"),
           ("exit/srun", "exit_s_vs_srun")]
SUMMARY_COLUMNS = COLUMNS
SUMMARY_NOTE = (
    "Every run includes its own `salloc` (the same for all tools). All nodes are network "
    "namespaces sharing this machine's cores, so 4N ranks start on the same CPUs whatever N; "
    "compare the ratios, not the absolute seconds.")


def metrics(t0: float, t_exit: float, stamps: list[dict]) -> dict[str, float]:
    return {"start": max(s["start"] for s in stamps) - t0, "exit": t_exit - t0}


def command(tool: str, slurm: Any, n: int, per_host: int, out: str) -> common.Launch:
    exe = common.BIN / "dtrain"
    dtrain = [str(exe)] if exe.exists() else [common.PYTHON, "-m", "launcher"]
    rank = [common.PYTHON, str(SCRIPT), out]
    inner = {"dtrain-slurm": [*dtrain, "launch", "--launcher", "slurm", "--", *rank],
             "srun": ["srun", "--mpi=none", *rank],
             "dtrain-ssh": [*dtrain, "launch", "--ssh-config", str(slurm.netns.ssh_config),
                            "--", *rank]}[tool]
    return common.Launch(["salloc", f"--nodes={n}", f"--ntasks-per-node={per_host}",
                          "--quiet", "--", *inner], {"SLURM_CONF": str(slurm.conf)})


def run_one(slurm: Any, tool: str, n: int, per_host: int) -> common.Sample:
    out = tempfile.mkdtemp(prefix="dtrain-bench-stamps-")
    try:
        sample = common.time_launch(command(tool, slurm, n, per_host, out), out, n * per_host,
                                    metrics, common.count_check, timeout=120)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    left = common.settle(slurm)
    if left and sample.error is None:
        return common.Sample(sample.metrics, f"processes left on nodes after exit: {left}")
    return sample


@contextlib.contextmanager
def slurm_cluster(n_hosts: int, given: Any = None) -> Iterator[Any]:
    """``given`` (a test's fixture, left open), else a new Slurm over hosts with sshd."""
    if given is not None:
        yield given
        return
    from testbed.netns import NetnsCluster, netns_available
    from testbed.slurm import SlurmCluster, slurm_available

    for usable, reason in (netns_available(), slurm_available()):
        if not usable:
            raise common.Skip(f"Slurm cluster unavailable: {reason}")
    hosts = NetnsCluster(n_hosts)
    try:
        slurm = SlurmCluster(hosts)
        try:
            yield slurm
        finally:
            slurm.close()
    finally:
        hosts.close()


def run(hosts: Sequence[int] = HOSTS, reps: int = 5, *, tools: Sequence[str] = TOOLS,
        per_host: int = PER_HOST, warmup: bool = True, cluster: Any = None,
        progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Rows {tool, hosts, ranks, start_s, exit_s (medians), *_min_s, *_vs_srun, ...}; on
    ``cluster`` (a `testbed.slurm.SlurmCluster`, left open) when given."""
    with slurm_cluster(max(hosts), cluster) as slurm:
        results = common.collect(slurm, list(tools), list(hosts), reps,
                                 lambda tool, n: run_one(slurm, tool, n, per_host),
                                 warmup, progress)
    rows = common.summarize("slurm", results, per_host, KEYS)
    rows.sort(key=lambda r: (tools.index(r["tool"]), r["hosts"]))
    if "srun" in tools:
        for key in ("start_s", "exit_s"):
            common.add_ratios(rows, key, base="srun")
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    common.print_rows(f"Launch time in a Slurm allocation: command start to every rank running, "
                      f"{common.describe(rows)} (dtrain --launcher slurm vs srun vs dtrain "
                      "over SSH)", rows, COLUMNS)


def main(argv: Sequence[str] | None = None) -> int:
    return grid.main(argv, name="slurm", doc=__doc__, hosts="1,2,4", tools=TOOLS,
                     per_host=PER_HOST, run=run, print_table=print_table)


if __name__ == "__main__":
    sys.exit(main())
