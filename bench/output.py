"""Output throughput through the launcher: lines/s and MB/s of rank output, dtrain vs Hydra.

    python -m bench.output [--hosts 2] [--per-host 2] [--lines 200000] [--long 200000]
                           [--reps 3] [--json PATH]

On a cluster of network-namespace hosts (one sshd each, `tests.cluster.netns`), N hosts x 2
ranks run ``bench/workers/flood.py LINES LONG`` (LINES short lines per rank in writes of 1000
lines, plus one LONG-byte line) under four launch commands, all over SSH from this head:

* ``dtrain prefixed``  ``dtrain launch -H ... -- python flood.py`` (``[rank@host] line``);
* ``dtrain raw``       the same with ``--raw``;
* ``hydra prefixed``   ``mpiexec.hydra -launcher ssh -prepend-rank ...`` (``[rank] line``);
* ``hydra raw``        the same without ``-prepend-rank``.

The launcher's stdout goes to a file. Every run is checked for loss (`flood.problems`: every
line of every rank present, whole, in order); a run with loss counts as failed. Each command
is also timed with LINES = LONG = 0 (start-up and exit only) in the same repetition, and the
rates are taken over the difference, so they measure output handling, not launching:
``lines/s = ranks x (LINES + 2) / (t_flood - t_empty)``, ``MB/s`` likewise with the bytes the
ranks wrote. Medians over the repetitions (tool order rotated each repetition), and each dtrain
row's ratio to Hydra's row of the same mode (target >= 0.5).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import common
from bench.workers import flood

SCRIPT = Path(flood.__file__)
TOOLS = ("dtrain prefixed", "dtrain raw", "hydra prefixed", "hydra raw")
COLUMNS = [("tool", "tool"), ("hosts", "hosts"), ("ranks", "ranks"), ("ok", "ok"),
           ("flood s", "flood_s"), ("empty s", "empty_s"), ("lines/s", "lines_per_s"),
           ("MB/s", "mb_per_s"), ("lines/s / Hydra", "lines_per_s_vs_hydra"),
           ("MB/s / Hydra", "mb_per_s_vs_hydra")]
SUMMARY_COLUMNS = COLUMNS
SUMMARY_NOTE = (
    "All namespace hosts share this one machine's CPUs: the ranks producing output, sshd, and "
    "the launcher consuming it compete for the same cores, so absolute rates are lower than "
    "on separate machines; compare the ratios. Rates are over the flood run's time minus the "
    "same command's empty run (start-up and exit excluded); every counted run lost nothing.")


def command(cluster: Any, tool: str, hosts: int, per_host: int, lines: int,
            long: int) -> common.Launch:
    kind, mode = tool.split()
    args = [str(lines), str(long)]
    if kind == "dtrain":
        launch = common.dtrain_launch(cluster, hosts, per_host, SCRIPT, args[0])
        argv = list(launch.argv)
        if mode == "raw":
            argv.insert(argv.index("launch") + 1, "--raw")
        return common.Launch(argv + args[1:], launch.env)
    launch = common.hydra_launch(cluster, hosts, per_host, SCRIPT, args[0])
    argv = list(launch.argv)
    if mode == "prefixed":
        argv.insert(1, "-prepend-rank")
    return common.Launch(argv + args[1:], launch.env)


def timed(launch: common.Launch, timeout: float = 300) -> tuple[float, bytes, str | None]:
    """Seconds from Popen to exit, the stdout bytes, and an error (None when rc 0)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(launch.argv, env={**common.base_env(), **launch.env},
                                cwd=common.REPO, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=err, start_new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session we started, by its PID
            proc.wait()
            return 0.0, b"", f"timed out after {timeout:.0f}s"
        seconds = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        tail = err.read().decode(errors="replace").strip().splitlines()[-3:]
        return seconds, out.read(), None if code == 0 else f"exit code {code}: {' | '.join(tail)}"


def one(cluster: Any, tool: str, hosts: int, per_host: int, lines: int,
        long: int) -> common.Sample:
    """A flood run and an empty run of one command; loss and leftovers make it fail."""
    ranks = hosts * per_host
    prefixed = tool.endswith("prefixed")
    got: dict[str, float] = {}
    for name, n, size in (("empty", 0, 0), ("flood", lines, long)):
        missing = common.tool_missing(tool.split()[0])
        if missing:
            return common.Sample(None, missing)
        seconds, stdout, error = timed(command(cluster, tool, hosts, per_host, n, size))
        left = common.settle(cluster)
        error = error or flood.problems(stdout, ranks, n, size, prefixed=prefixed)
        if error or left:
            return common.Sample(None, f"{name} run: {error or f'processes left: {left}'}")
        got[name] = seconds
    return common.Sample(got)


def run(hosts: int = 2, per_host: int = 2, lines: int = 200000, long: int = 200000,
        reps: int = 3, *, tools: Sequence[str] = TOOLS, cluster: Any = None,
        progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Rows {tool, hosts, ranks, flood_s, empty_s, lines_per_s, mb_per_s, ratios, ...}."""
    ranks = hosts * per_host
    written = [flood.expected(rank, lines, long) for rank in range(ranks)]
    total_lines = sum(len(lines_of_rank) for lines_of_rank in written)
    total_bytes = sum(len(line) + 1 for lines_of_rank in written for line in lines_of_rank)
    del written
    with common.bench_cluster(hosts, cluster) as used:
        results = common.collect(
            used, list(tools), [hosts], reps,
            lambda tool, n: one(used, tool, n, per_host, lines, long), warmup=False,
            progress=progress)
    rows = []
    for tool in tools:
        samples = results[tool, hosts]
        good = [s.metrics for s in samples if s.metrics]
        net = [m["flood"] - m["empty"] for m in good]
        row: dict[str, Any] = {
            "bench": "output", "tool": tool, "hosts": hosts, "ranks": ranks, "reps": reps,
            "ok": len(good), "lines": total_lines, "bytes": total_bytes,
            "flood_s": statistics.median(m["flood"] for m in good) if good else None,
            "empty_s": statistics.median(m["empty"] for m in good) if good else None,
            "lines_per_s": total_lines / statistics.median(net) if net else None,
            "mb_per_s": total_bytes / 1e6 / statistics.median(net) if net else None}
        errors = [s.error for s in samples if s.error]
        if errors:
            row["error"] = errors[0]
        rows.append(row)
    for row in rows:
        kind, mode = row["tool"].split()
        if kind == "dtrain":
            ref = next((r for r in rows if r["tool"] == f"hydra {mode}"), {})
            for key in ("lines_per_s", "mb_per_s"):
                mine, theirs = row[key], ref.get(key)
                row[f"{key}_vs_hydra"] = mine / theirs if mine and theirs else None
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    lines = rows[0]["lines"] if rows else 0
    common.print_rows(f"Output throughput over SSH: {lines} lines through the launcher, "
                      f"{common.describe(rows)} (dtrain vs mpiexec.hydra)", rows, COLUMNS)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.output", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--per-host", type=int, default=2)
    ap.add_argument("--lines", type=int, default=200000, help="short lines per rank")
    ap.add_argument("--long", type=int, default=200000, help="bytes of the one long line")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    if min(args.hosts, args.per_host, args.reps, args.lines) < 1:
        ap.error("--hosts, --per-host, --reps and --lines must be at least 1")
    try:
        rows = run(args.hosts, args.per_host, args.lines, args.long, args.reps,
                   progress=lambda line: print(line, file=sys.stderr, flush=True))
    except common.Skip as why:
        print(f"output skipped: {why}", file=sys.stderr)
        return 0
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
