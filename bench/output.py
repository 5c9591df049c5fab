"""Output throughput through the launcher: lines/s and MB/s of rank output, dtrain vs Hydra.

    python -m bench.output [--hosts 2] [--per-host 2] [--lines 200000] [--long 200000]
                           [--reps 3] [--json PATH]

On a cluster of network-namespace hosts (one sshd each, `testbed.netns`), N hosts x 2
ranks run ``bench/workers/flood.py LINES LONG`` (LINES short lines per rank in writes of 1000
lines, plus one LONG-byte line) under four launch commands, all over SSH from this head:

* ``dtrain prefixed``  ``dtrain launch -H ... -- python flood.py`` (``[rank@host] line``);
* ``dtrain raw``       the same with ``--raw``;
* ``hydra prefixed``   ``mpiexec.hydra -launcher ssh -prepend-rank ...`` (``[rank] line``);
* ``hydra raw``        the same without ``-prepend-rank``.

Each rank stamps ``time.time()`` just before its first write (the namespaces share the clock);
the bench reads the launcher's stdout from a pipe as fast as it comes, and the rates are over
the span from the first rank's first write to the last byte read (launching and exiting
excluded, buffering on the way included): ``lines/s = lines / span``, ``MB/s`` likewise with
the bytes the ranks wrote (prefixes not counted). Every run is checked for loss (`flood.lost`:
every line and byte arrived, prefixes aside); a run with loss counts as failed. Whether every
line also arrived whole and in order per rank (`flood.problems`) is counted in "runs with
whole lines":
Hydra relays bytes as they come, so its ranks' lines can be cut into each other. Medians over
the repetitions (tool order rotated each repetition), and each dtrain row's ratio to Hydra's
row of the same mode (target >= 0.5).
"""

from __future__ import annotations

import argparse
import os
import select
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
           ("first byte s", "first_s"), ("span s", "span_s"), ("exit s", "exit_s"),
           ("lines/s", "lines_per_s"),
           ("MB/s", "mb_per_s"), ("runs with whole lines", "whole_lines"),
           ("lines/s / Hydra", "lines_per_s_vs_hydra"),
           ("MB/s / Hydra", "mb_per_s_vs_hydra")]
SUMMARY_COLUMNS = COLUMNS
SUMMARY_NOTE = (
    "All namespace hosts share this one machine's CPUs: the ranks producing output, sshd, and "
    "the launcher consuming it compete for the same cores, so absolute rates are lower than "
    "on separate machines; compare the ratios. Times are from the first rank's first write; "
    "rates are over the span to the last byte read (start-up and exit excluded); every "
    "counted run lost nothing.")


def command(cluster: Any, tool: str, hosts: int, per_host: int, lines: int, long: int,
            stamps: str) -> common.Launch:
    kind, mode = tool.split()
    args = [str(lines), str(long), stamps]
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


def timed(launch: common.Launch,
          timeout: float = 300) -> tuple[dict[str, float], bytes, str | None]:
    """Read the launcher's stdout as it comes: {first, last, exit} as ``time.time()``, the
    bytes, and an error (None when it exited 0)."""
    with tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(launch.argv, env={**common.base_env(), **launch.env},
                                cwd=common.REPO, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        assert proc.stdout is not None  # stdout=PIPE
        out, stamps = bytearray(), {"first": 0.0, "last": 0.0}
        deadline = t0 + timeout
        fd = proc.stdout.fileno()
        while time.monotonic() < deadline:
            if not select.select([fd], [], [], 1.0)[0]:
                continue
            data = os.read(fd, 1 << 20)
            if not data:
                break
            stamps["last"] = time.time()
            stamps["first"] = stamps["first"] or stamps["last"]
            out += data
        try:
            code = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session we started, by its PID
            proc.wait()
            return stamps, bytes(out), f"timed out after {timeout:.0f}s"
        finally:
            proc.stdout.close()
        stamps["exit"] = time.time()
        err.seek(0)
        tail = err.read().decode(errors="replace").strip().splitlines()[-3:]
        return stamps, bytes(out), None if code == 0 else f"exit code {code}: {' | '.join(tail)}"


def one(cluster: Any, tool: str, hosts: int, per_host: int, lines: int,
        long: int) -> common.Sample:
    """One run: loss, a failed exit or leftovers on the hosts make it fail."""
    missing = common.tool_missing(tool.split()[0])
    if missing:
        return common.Sample(None, missing)
    ranks = hosts * per_host
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-flood-") as stamp_dir:
        got, stdout, error = timed(command(cluster, tool, hosts, per_host, lines, long,
                                           stamp_dir))
        starts = [float(p.read_text()) for p in Path(stamp_dir).iterdir()]
    left = common.settle(cluster)
    error = error or flood.lost(stdout, ranks, lines, long)
    if not error and len(starts) != ranks:
        error = f"{len(starts)} of {ranks} ranks stamped their start"
    if error or left:
        return common.Sample(None, error or f"processes left on hosts: {left}")
    whole = flood.problems(stdout, ranks, lines, long, prefixed=tool.endswith("prefixed"))
    start = min(starts)
    return common.Sample({"first": got["first"] - start, "span": got["last"] - start,
                          "exit": got["exit"] - start, "whole": float(whole is None)})


def run(hosts: int = 2, per_host: int = 2, lines: int = 200000, long: int = 200000,
        reps: int = 3, *, tools: Sequence[str] = TOOLS, cluster: Any = None,
        progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Rows {tool, hosts, ranks, first_s, span_s, exit_s, lines_per_s, mb_per_s, ratios}."""
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
        span = statistics.median(m["span"] for m in good) if good else None
        row: dict[str, Any] = {
            "bench": "output", "tool": tool, "hosts": hosts, "ranks": ranks, "reps": reps,
            "ok": len(good), "lines": total_lines, "bytes": total_bytes, "span_s": span,
            "first_s": statistics.median(m["first"] for m in good) if good else None,
            "exit_s": statistics.median(m["exit"] for m in good) if good else None,
            "lines_per_s": total_lines / span if span else None,
            "mb_per_s": total_bytes / 1e6 / span if span else None,
            "whole_lines": f"{sum(m['whole'] for m in good):.0f}/{len(good)}"}
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
    return common.report(rows, print_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
