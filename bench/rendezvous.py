"""Rendezvous launch time: command start to every rank running, with a process started on every
host by something else (as Kubernetes starts a pod per node), against torchrun's rendezvous.

    python -m bench.rendezvous [--hosts 1,2,4,8] [--reps 5] [--per-host 4] [--json PATH]

One cluster of network-namespace hosts (`testbed.netns`) is built once; on the first N hosts x
4 ranks three ways start the same rank program (``bench/workers/stamp.py``: it stamps
``time.time()`` first thing and exits 0):

* ``dtrain-rdzv``  ``dtrain launch --rendezvous-port P --nnodes N --nproc-per-node 4`` on the
                   head (the root namespace) and ``dtrain agent --rendezvous HEAD:P`` in every
                   host, all started at once;
* ``dtrain-ssh``   ``dtrain launch -H node1:4,...``: the head starts the agents over SSH;
* ``torchrun``     ``torchrun --nnodes N --nproc-per-node 4 --rdzv-backend c10d
                   --rdzv-endpoint NODE1:P`` in every host, all at once (node1's hosts the c10d
                   store: ``is_host``; ``--local-addr`` its own address, since a namespace's
                   host name does not resolve).

A process "in a host" runs under ``ip netns exec`` with its own host name (``unshare --uts``),
for dtrain's agents and torchrun alike. ``t0`` is taken just before the first ``Popen``;
``start`` = the last rank's stamp - t0 (every rank running), ``exit`` = the last of the
processes started exited - t0. Tables show medians and minima, each tool's ratio to torchrun
(target: dtrain-rdzv <= 1 at every host count) and its growth over 1 host.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import common, grid
from launcher.rendezvous import tokens

HOSTS = (1, 2, 4, 8)
TOOLS = ("dtrain-rdzv", "dtrain-ssh", "torchrun")
PER_HOST = 4
SCRIPT = common.WORKERS / "stamp.py"
KEYS = ("start", "exit")
COLUMNS = [("tool", "tool"), ("hosts", "hosts"), ("ranks", "ranks"), ("ok", "ok"),
           ("running s", "start_s"), ("min", "start_min_s"), ("exit s", "exit_s"),
           ("running/torchrun", "start_s_vs_torchrun"), ("exit/torchrun", "exit_s_vs_torchrun"),
           ("running/1 host", "start_s_growth")]
SUMMARY_COLUMNS = COLUMNS
SUMMARY_NOTE = (
    "All namespace hosts share this one machine's CPUs: N hosts start N agents (or torchruns) "
    "and 4N ranks on the same cores, so growth with the host count includes contention that "
    "separate machines would not have. Runs are interleaved, tool order rotated each "
    "repetition; compare the ratios, not the absolute seconds.")


def in_host(cluster: Any, host: str, argv: Sequence[str]) -> list[str]:
    """``argv`` in ``host``'s network namespace, under that host's own host name."""
    return ["ip", "netns", "exec", cluster.namespace(host), "unshare", "--uts", "--", "sh", "-c",
            'hostname "$1" && shift && exec "$@"', "sh", host, *argv]


def _dtrain() -> list[str]:
    exe = common.BIN / "dtrain"
    return [str(exe)] if exe.exists() else [common.PYTHON, "-m", "launcher"]


def dtrain_rdzv(cluster: Any, n: int, per_host: int, out: str, token: str) -> list[list[str]]:
    port = common_port()
    head = [*_dtrain(), "launch", "--rendezvous-port", str(port), "--rendezvous-host",
            cluster.head_address, "--nnodes", str(n), "--nproc-per-node", str(per_host),
            "--token-file", token, "--", common.PYTHON, str(SCRIPT), out]
    agent = [*_dtrain(), "agent", "--rendezvous", f"{cluster.head_address}:{port}",
             "--token-file", token]
    return [head, *(in_host(cluster, host, agent) for host in cluster.hosts[:n])]


def dtrain_ssh(cluster: Any, n: int, per_host: int, out: str, token: str) -> list[list[str]]:
    return [common.dtrain_launch(cluster, n, per_host, SCRIPT, out).argv]


def torchrun(cluster: Any, n: int, per_host: int, out: str, token: str) -> list[list[str]]:
    port, first, run_id = common_port(), cluster.hosts[0], secrets.token_hex(4)
    exe = str(common.BIN / "torchrun")
    return [in_host(cluster, host, [
        exe, "--nnodes", str(n), "--nproc-per-node", str(per_host), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{cluster.address(first)}:{port}", "--rdzv-id", run_id,
        "--rdzv-conf", f"is_host={int(host == first)}", "--local-addr", cluster.address(host),
        "--max-restarts", "0", "--", str(SCRIPT), out])  # torchrun runs it with its python
        for host in cluster.hosts[:n]]


COMMANDS: dict[str, Callable[..., list[list[str]]]] = {
    "dtrain-rdzv": dtrain_rdzv, "dtrain-ssh": dtrain_ssh, "torchrun": torchrun}


def common_port() -> int:
    """A port for this run (the same number is free in every namespace: they start empty)."""
    from testbed.sshd import free_port

    return free_port()


def time_group(argvs: list[list[str]], out_dir: str, ranks: int,
               timeout: float) -> common.Sample:
    """Start every command at once; wait for all of them; the stamps tell when ranks ran."""
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryFile() as log:
        t0 = time.time()
        for argv in argvs:
            procs.append(subprocess.Popen(argv, env=common.base_env(), cwd=common.REPO,
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                          start_new_session=True))
        codes, deadline = [], time.monotonic() + timeout
        for proc in procs:
            try:
                codes.append(proc.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for other in procs:  # the sessions we started, by their PIDs
                    if other.poll() is None:
                        os.killpg(other.pid, signal.SIGKILL)
                        other.wait()
                return common.Sample(None, f"timed out after {timeout:.0f}s")
        t_exit = time.time()
        log.seek(0)
        tail = log.read().decode(errors="replace").strip().splitlines()[-3:]
    if any(codes):
        return common.Sample(None, f"exit codes {codes}: {' | '.join(tail)}")
    stamps = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("*.json"))]
    problem = common.count_check(stamps, ranks)
    if problem:
        return common.Sample(None, problem)
    return common.Sample({"start": max(s["start"] for s in stamps) - t0, "exit": t_exit - t0})


def run_one(cluster: Any, tool: str, n: int, per_host: int, token: str) -> common.Sample:
    out_dir = tempfile.mkdtemp(prefix="dtrain-bench-stamps-")
    try:
        sample = time_group(COMMANDS[tool](cluster, n, per_host, out_dir, token), out_dir,
                            n * per_host, timeout=120)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    left = common.settle(cluster)
    if left and sample.error is None:
        return common.Sample(sample.metrics, f"processes left on hosts after exit: {left}")
    return sample


def run(hosts: Sequence[int] = HOSTS, reps: int = 5, *, tools: Sequence[str] = TOOLS,
        per_host: int = PER_HOST, warmup: bool = True, cluster: Any = None,
        progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Rows {tool, hosts, ranks, start_s, exit_s (medians), *_min_s, ratios to torchrun}."""
    with common.bench_cluster(max(hosts), cluster) as used, \
            tempfile.TemporaryDirectory(prefix="dtrain-bench-token-") as folder:
        token = Path(folder, "token")
        tokens.write(str(token))  # the form the head accepts, owner-only

        def one(tool: str, n: int) -> common.Sample:
            return run_one(used, tool, n, per_host, str(token))

        results = common.collect(used, list(tools), list(hosts), reps, one, warmup, progress)
    rows = common.summarize("rendezvous", results, per_host, KEYS)
    rows.sort(key=lambda r: (tools.index(r["tool"]), r["hosts"]))
    if "torchrun" in tools:
        for key in ("start_s", "exit_s"):
            common.add_ratios(rows, key, base="torchrun")
    common.add_growth(rows, "start_s")
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    common.print_rows("Rendezvous launch time: command start to every rank running and to "
                      f"exit, {common.describe(rows)} (dtrain agents joining, dtrain over SSH, "
                      "torchrun c10d)", rows, COLUMNS)


def main(argv: Sequence[str] | None = None) -> int:
    return grid.main(argv, name="rendezvous", doc=__doc__, hosts=",".join(map(str, HOSTS)),
                     tools=TOOLS, per_host=PER_HOST, run=run, print_table=print_table)


if __name__ == "__main__":
    sys.exit(main())
