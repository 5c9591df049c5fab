"""The command line shared by the launch-grid benches (launch_time, wireup, slurm): every tool at
every host count, ``--reps`` times, the table printed and optionally kept as JSON."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from bench import common


def main(argv: Sequence[str] | None, *, name: str, doc: str | None, hosts: str,
         tools: Sequence[str], per_host: int, run: Callable[..., list[common.Row]],
         print_table: Callable[[list[common.Row]], None]) -> int:
    """``python -m bench.<name> [--hosts] [--reps] [--per-host] [--tools] [--json]``; a bench
    that cannot run here (`common.Skip`) says why and exits 0."""
    ap = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", default=hosts, help=f"host counts, e.g. {hosts}")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--per-host", type=int, default=per_host)
    ap.add_argument("--tools", default=",".join(tools))
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.per_host < 1:
        ap.error("--reps and --per-host must be at least 1")
    try:
        rows = run([int(n) for n in args.hosts.split(",")], args.reps,
                   tools=args.tools.split(","), per_host=args.per_host,
                   progress=lambda line: print(line, file=sys.stderr, flush=True))
    except common.Skip as why:
        print(f"{name} skipped: {why}", file=sys.stderr)
        return 0
    return common.report(rows, print_table, args.json)

