"""Shared machinery of the launch benches: peer tools' command lines, one timed run, medians.

A *run* starts one launcher command (dtrain, MPICH Hydra's ``mpiexec.hydra -launcher ssh`` or
``pdsh``) on the first N hosts of a network-namespace cluster (`testbed.netns`), with a
rank program from ``bench/workers`` that writes a JSON stamp per rank into a shared directory
(the namespaces share the filesystem and the clock). ``t0`` is taken just before ``Popen``;
the launcher's own exit is taken when ``wait`` returns. After every run the hosts must be
empty again (only their sshd) before the next run starts, so one tool's stragglers never load
another tool's measurement.

`collect` runs the grid with the repetition outermost and the tools' order rotated in each
repetition, so drifting load on this shared machine hits every tool and host count alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORKERS = REPO / "bench" / "workers"
PYTHON = sys.executable
BIN = Path(sys.executable).parent
if str(REPO) not in sys.path:  # the cluster fixture lives in tests/ (python -m bench.x from REPO)
    sys.path.insert(0, str(REPO))

Row = dict[str, Any]


class Skip(Exception):
    """The bench cannot run on this machine (not root, no network namespaces); says why."""


@dataclass(frozen=True)
class Launch:
    """One command to time: its argv and what it adds to the environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def base_env() -> dict[str, str]:
    """The head's environment minus inherited PMI state (MPICH refuses PMIX_*, Hydra's own
    PMI_* would be misread by the ranks), with one OpenMP thread per rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_"))}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(REPO)
    return env


def host_list(n_hosts: int, per_host: int) -> str:
    return ",".join(f"node{i}:{per_host}" for i in range(1, n_hosts + 1))


def dtrain_launch(cluster: Any, n_hosts: int, per_host: int, script: Path, out: str,
                  client: str = "paramiko") -> Launch:
    exe = BIN / "dtrain"
    head = [str(exe)] if exe.exists() else [PYTHON, "-m", "launcher"]
    return Launch([*head, "launch", "-H", host_list(n_hosts, per_host), "--ssh-client", client,
                   "--ssh-config", str(cluster.ssh_config), "--", PYTHON, str(script), out])


def dtrain_openssh_launch(cluster: Any, n_hosts: int, per_host: int, script: Path,
                          out: str) -> Launch:
    """dtrain with --ssh-client openssh: one `ssh` process per host, no paramiko."""
    return dtrain_launch(cluster, n_hosts, per_host, script, out, client="openssh")


def hydra_launch(cluster: Any, n_hosts: int, per_host: int, script: Path, out: str) -> Launch:
    # Hydra's proxies connect back to mpiexec by the head's hostname, which inside a namespace
    # host names that host's own loopback: -localhost gives them the bridge address instead.
    # HYDRA_LAUNCHER_EXTRA_ARGS is appended to every ssh command (split on spaces).
    argv = [str(BIN / "mpiexec.hydra"), "-launcher", "ssh", "-launcher-exec", _ssh(),
            "-localhost", cluster.head_address, "-hosts", host_list(n_hosts, per_host),
            "-n", str(n_hosts * per_host), PYTHON, str(script), out]
    return Launch(argv, {"HYDRA_LAUNCHER_EXTRA_ARGS": f"-F {cluster.ssh_config}"})


def pdsh_launch(cluster: Any, n_hosts: int, per_host: int, script: Path, out: str) -> Launch:
    # DeepSpeed's pdsh mode: one remote shell per host starts that host's ranks and waits.
    # -S makes pdsh return the largest remote exit code, so a failed rank is not hidden.
    rank = f"{shlex.quote(PYTHON)} {shlex.quote(str(script))} {shlex.quote(out)}"
    indexes = " ".join(str(i) for i in range(per_host))
    remote = f"for i in {indexes}; do {rank} $i & done; wait"
    hosts = ",".join(f"node{i}" for i in range(1, n_hosts + 1))
    return Launch([_which("pdsh"), "-S", "-f", "64", "-w", hosts, remote],
                  {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": f"-F {cluster.ssh_config}"})


TOOLS: dict[str, Callable[..., Launch]] = {
    "dtrain": dtrain_launch, "dtrain-openssh": dtrain_openssh_launch, "hydra": hydra_launch,
    "pdsh": pdsh_launch}


def _which(name: str) -> str:
    return shutil.which(name) or name


def _ssh() -> str:
    return shutil.which("ssh") or "/usr/bin/ssh"


def tool_missing(tool: str) -> str | None:
    """Why ``tool`` cannot run here, or None."""
    needs = {"dtrain": [], "dtrain-openssh": [_ssh()],
             "hydra": [str(BIN / "mpiexec.hydra"), _ssh()],
             "pdsh": [_which("pdsh"), _ssh()]}[tool]
    for path in needs:
        if not os.access(path, os.X_OK):
            return f"{tool}: `{path}` not found or not executable"
    return None


@dataclass(frozen=True)
class Sample:
    """One run: ``metrics`` (seconds since t0) when it worked, ``error`` when it did not."""

    metrics: dict[str, float] | None
    error: str | None = None


Metrics = Callable[[float, float, list[dict]], dict[str, float]]
Check = Callable[[list[dict], int], str | None]


def count_check(stamps: list[dict], ranks: int) -> str | None:
    return None if len(stamps) == ranks else f"{len(stamps)} of {ranks} ranks left a stamp"


def time_launch(launch: Launch, out_dir: str, ranks: int, metrics: Metrics, check: Check,
                timeout: float) -> Sample:
    """Run ``launch`` once; its ranks write their stamps into ``out_dir``."""
    with tempfile.TemporaryFile() as log:
        t0 = time.time()
        proc = subprocess.Popen(launch.argv, env={**base_env(), **launch.env}, cwd=REPO,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session we started, by its PID
            proc.wait()
            return Sample(None, f"timed out after {timeout:.0f}s")
        t_exit = time.time()
        log.seek(0)
        tail = log.read().decode(errors="replace").strip().splitlines()[-3:]
    if code != 0:
        return Sample(None, f"exit code {code}: {' | '.join(tail)}")
    stamps = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("*.json"))]
    problem = check(stamps, ranks)
    if problem:
        return Sample(None, problem)
    return Sample(metrics(t0, t_exit, stamps))


def run_one(cluster: Any, tool: str, n_hosts: int, per_host: int, script: Path,
            metrics: Metrics, check: Check = count_check, timeout: float = 120) -> Sample:
    """Time one launch of ``script`` by ``tool`` on node1..nodeN, then wait for empty hosts."""
    missing = tool_missing(tool)
    if missing:
        return Sample(None, missing)
    out_dir = tempfile.mkdtemp(prefix="dtrain-bench-stamps-")
    try:
        launch = TOOLS[tool](cluster, n_hosts, per_host, script, out_dir)
        sample = time_launch(launch, out_dir, n_hosts * per_host, metrics, check, timeout)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    left = settle(cluster)
    if left and sample.error is None:
        return Sample(sample.metrics, f"processes left on hosts after exit: {left}")
    return sample


def settle(cluster: Any, timeout: float = 10) -> dict[str, int]:
    """Wait until every host runs only its sshd; SIGKILL what is left (PIDs that `ip netns
    pids` lists inside our own namespaces). Returns {host: leftover count} ({} when clean)."""
    from testbed.sshd import kill_pids

    left = cluster.wait_no_job_pids(timeout)
    for pids in left.values():
        kill_pids(pids)
    return {host: len(pids) for host, pids in left.items()}


@contextlib.contextmanager
def bench_cluster(n_hosts: int, cluster: Any = None) -> Iterator[Any]:
    """``cluster`` when given (a test's fixture, left open), else a new one closed at the end."""
    if cluster is not None:
        if len(cluster.hosts) < n_hosts:
            raise ValueError(f"the given cluster has {len(cluster.hosts)} hosts, need {n_hosts}")
        yield cluster
        return
    from testbed.netns import NetnsCluster, netns_available

    usable, reason = netns_available()
    if not usable:
        raise Skip(f"network-namespace cluster unavailable: {reason}")
    own = NetnsCluster(n_hosts)
    try:
        yield own
    finally:
        own.close()


def collect(cluster: Any, tools: Sequence[str], hosts: Sequence[int], reps: int,
            run: Callable[[str, int], Sample], warmup: bool = True,
            progress: Callable[[str], None] | None = None) -> dict[tuple[str, int], list[Sample]]:
    """Every (tool, host count) ``reps`` times: repetition outermost, tool order rotated."""
    if warmup:  # page cache, sshd's first fork, Python's .pyc files: not what we measure
        for tool in tools:
            run(tool, max(hosts))
    results: dict[tuple[str, int], list[Sample]] = {(t, n): [] for t in tools for n in hosts}
    for rep in range(reps):
        order = [tools[(rep + i) % len(tools)] for i in range(len(tools))]
        for n in hosts:
            for tool in order:
                sample = run(tool, n)
                results[tool, n].append(sample)
                if progress:
                    got = sample.error or "  ".join(
                        f"{k} {v:.3f}s" for k, v in (sample.metrics or {}).items())
                    progress(f"rep {rep + 1}/{reps}  {n} hosts  {tool:<6}  {got}")
    return results


def summarize(bench: str, results: dict[tuple[str, int], list[Sample]], per_host: int,
              keys: Sequence[str]) -> list[Row]:
    """One row per (tool, hosts): median ``<key>_s`` and ``<key>_min_s`` over working runs."""
    rows = []
    for (tool, n), samples in results.items():
        good = [s.metrics for s in samples if s.metrics is not None and s.error is None]
        row: Row = {"bench": bench, "tool": tool, "hosts": n, "ranks": n * per_host,
                    "reps": len(samples), "ok": len(good)}
        for key in keys:
            values = [m[key] for m in good]
            row[f"{key}_s"] = statistics.median(values) if values else None
            row[f"{key}_min_s"] = min(values) if values else None
        errors = [s.error for s in samples if s.error]
        if errors:
            row["error"] = errors[0]
        row["samples"] = good
        rows.append(row)
    return rows


def add_ratios(rows: list[Row], key: str, base: str = "hydra") -> None:
    """``<key>_vs_<base>`` on every other tool's row: its median over ``base``'s, same hosts."""
    ref = {r["hosts"]: r.get(key) for r in rows if r["tool"] == base}
    for row in rows:
        if row["tool"] != base:
            row[f"{key}_vs_{base}"] = _ratio(row.get(key), ref.get(row["hosts"]))


def add_growth(rows: list[Row], key: str) -> None:
    """``<key>_growth``: the median over the same tool's median at its fewest hosts (1.0 = flat)."""
    for row in rows:
        mine = [r for r in rows if r["tool"] == row["tool"]]
        first = min(mine, key=lambda r: r["hosts"])
        row[f"{key}_growth"] = _ratio(row.get(key), first.get(key))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def print_rows(title: str, rows: list[Row], columns: Sequence[tuple[str, str]]) -> None:
    """A rich table of ``columns`` ((header, key) pairs); seconds and ratios to 3 digits."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for header, _ in columns:
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(*(fmt(row.get(key)) for _, key in columns))
    console = Console()
    if not console.is_terminal:  # piped into a file: do not squeeze to 80 columns
        console = Console(width=160)
    console.print(table)
    for row in rows:
        if row.get("error"):
            print(f"  {row['tool']} on {row['hosts']} hosts: {row['ok']}/{row['reps']} runs "
                  f"worked; first failure: {row['error']}")


def describe(rows: list[Row]) -> str:
    """"4 ranks per host, median of 5 runs" for a table title."""
    if not rows:
        return "no runs"
    per_host = rows[0]["ranks"] // rows[0]["hosts"]
    return f"{per_host} ranks per host, median of {max(r['reps'] for r in rows)} runs"


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def report(rows: list[Row], print_table: Callable[[list[Row]], None],
           json_path: str | None) -> int:
    """Every bench's ending: the table on stdout, the rows as JSON when asked; exit code 0."""
    print_table(rows)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    return 0


def rank_bench_main(args: Any, run: Callable[..., list[Row]],
                    worker: Callable[[Any], dict[str, Any]],
                    print_table: Callable[[list[Row]], None]) -> int:
    """The ending of a bench whose ranks rerun its own module with ``--worker --out DIR``:
    a worker saves its result; the parent runs the bench with the other options and reports."""
    if args.worker:
        return save_rank_result(args.out, worker(args))
    options = {k: v for k, v in vars(args).items() if k not in ("json", "worker", "out")}
    return report(run(**options), print_table, args.json)


def rich_table(title: str, columns: Sequence[tuple[str, str]], rows: list[Row], *,
               digits: int, width: int) -> None:
    """Rows as a rich table on stdout, floats to ``digits`` places (``width`` when piped)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for head, _ in columns:
        table.add_column(head, justify="right")
    for row in rows:
        table.add_row(*(f"{row[k]:.{digits}f}" if isinstance(row[k], float) else str(row[k])
                        for _, k in columns))
    Console(width=None if sys.stdout.isatty() else width).print(table)


def save_rank_result(out: str, result: dict[str, Any]) -> int:
    """A bench worker rank's ending: its result as ``<out>/rank<r>.json``; exit code 0."""
    Path(out, f"rank{result['rank']}.json").write_text(json.dumps(result))
    return 0


def with_dtrain_linears(model: Any) -> Any:
    """``model`` with every ``nn.Linear`` computing through dtrain's kernel (same weights)."""
    import torch

    from trainer.model.linear import linear

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = lambda x, m=module: linear(x, m.weight, m.bias)
    return model
