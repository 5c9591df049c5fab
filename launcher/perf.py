"""`dtrain check --perf`: a short matmul on every host and an all-reduce between every pair of
hosts, with the slow ones flagged.

The measurement is a real job: `dtrain launch` with one rank per host running
``python -m trainer.health.perf`` (started as a program, so the launcher imports nothing of the
trainer), whose rank 0 prints ``DTRAIN_PERF <json>``. `judge` (pure) flags a host whose matmul
speed is below `SLOW_HOST` x the median of the hosts, and a link whose all-reduce bandwidth is
below `SLOW_LINK` x the median of the links (a link is the pair of hosts; which end is at
fault shows in how many of its links a host appears).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table

from launcher.launch import HostRequest
from launcher.transport.local import python_module
from launcher.transport.options import SSHOptions

PREFIX = "DTRAIN_PERF "
SLOW_HOST = 0.7
SLOW_LINK = 0.5
TIMEOUT_S = 600.0


@dataclass(frozen=True)
class PerfReport:
    hosts: dict[str, float]                 # host -> matmul GFLOP/s (its slowest rank)
    links: list[tuple[str, str, float]]     # (host, host, all-reduce bus bandwidth GB/s)
    slow_hosts: list[str]
    slow_links: list[tuple[str, str]]


def judge(result: dict[str, Any]) -> PerfReport:
    hosts = {str(h): float(g) for h, g in result.get("hosts", {}).items()}
    links = [(str(a), str(b), float(bw)) for a, b, bw in result.get("links", [])]
    slow_hosts, slow_links = [], []
    if len(hosts) >= 2:
        median = statistics.median(hosts.values())
        slow_hosts = [h for h, g in hosts.items() if g < SLOW_HOST * median]
    if len(links) >= 2:
        median = statistics.median(bw for _, _, bw in links)
        slow_links = [(a, b) for a, b, bw in links if bw < SLOW_LINK * median]
    return PerfReport(hosts, links, slow_hosts, slow_links)


def launch_argv(hosts: HostRequest, ssh: SSHOptions, python: str) -> list[str]:
    """`dtrain launch` of the probe on the same hosts, one rank on each."""
    argv = [*python_module(sys.executable, "launcher"), "launch", "--nproc-per-node", "1",
            "--no-prefix"]
    for flag, value in (("--hostfile", hosts.hostfile), ("-H", hosts.hosts),
                        ("--include", hosts.include), ("--exclude", hosts.exclude),
                        ("--num-nodes", hosts.num_nodes), ("--ssh-config", ssh.config_file),
                        ("--known-hosts", ssh.known_hosts),
                        ("--ssh-connect-timeout", ssh.connect_timeout)):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--ssh-accept-new"] if ssh.accept_new else []
    argv += ["--ssh-allow-config-exec"] if ssh.allow_config_exec else []
    return [*argv, "--remote-python", python, "--", *python_module(python, "trainer.health.perf")]


def measure(hosts: HostRequest, ssh: SSHOptions, python: str, cwd: str) -> dict[str, Any]:
    done = subprocess.run(launch_argv(hosts, ssh, python), capture_output=True, text=True,
                          cwd=cwd, timeout=TIMEOUT_S)
    for line in done.stdout.splitlines():
        if line.startswith(PREFIX):
            return dict(json.loads(line[len(PREFIX):]))
    tail = " | ".join(done.stderr.strip().splitlines()[-3:])
    raise RuntimeError(f"the perf job failed with exit code {done.returncode}: {tail}")


def print_report(report: PerfReport, out: TextIO) -> None:
    console = Console(file=out, highlight=False, markup=False, width=120)
    hosts = Table(title="matmul fp32 per host", title_justify="left")
    for col in ("host", "GFLOP/s", "result"):
        hosts.add_column(col)
    for h, g in report.hosts.items():
        hosts.add_row(h, f"{g:.1f}", "SLOW" if h in report.slow_hosts else "ok")
    console.print(hosts)
    links = Table(title="all-reduce 1 MiB, host pairs", title_justify="left")
    for col in ("hosts", "busbw GB/s", "result"):
        links.add_column(col)
    for a, b, bw in report.links:
        links.add_row(f"{a} - {b}", f"{bw:.3f}", "SLOW" if (a, b) in report.slow_links else "ok")
    console.print(links)


def run_perf(hosts: HostRequest, ssh: SSHOptions, python: str, cwd: str,
             out: TextIO = sys.stdout) -> int:
    """1 when a host or link is slow or the job failed, else 0."""
    try:
        report = judge(measure(hosts, ssh, python, cwd))
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"dtrain check --perf: {exc}", file=sys.stderr)
        return 1
    print_report(report, out)
    problems = [f"host {h} computes below {SLOW_HOST:.0%} of the median host"
                for h in report.slow_hosts]
    problems += [f"link {a} - {b} is below {SLOW_LINK:.0%} of the median link bandwidth"
                 for a, b in report.slow_links]
    for problem in problems:
        print(f"dtrain check --perf: {problem}", file=sys.stderr)
    return 1 if problems else 0

