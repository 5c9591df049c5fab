"""Shared machinery of the benches whose ranks run under the MPICH wheel's ``mpiexec``.

Such a bench is one module run two ways: as the driver (``python -m bench.x``), which starts
``python -m bench.x --worker --out DIR <options>`` on N ranks and reads back one
``rank<r>.json`` per rank, and as that worker. The sides a worker compares take their steps
interleaved, the order rotating every step, so drifting load on a shared machine hits every
side alike.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Protocol

from bench import common

Row = dict[str, Any]


class Side(Protocol):
    """One thing a worker times: a layout, a variant, a technique."""

    def step(self, i: int, timed: bool) -> None: ...


def add_worker_options(ap: argparse.ArgumentParser, *, timeout: float) -> None:
    """The options every such bench has: --timeout, --json, and the hidden worker pair."""
    ap.add_argument("--timeout", type=float, default=timeout)
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)


def interleave(world: Any, sides: Sequence[Side], *, warmup: int, steps: int) -> None:
    """``warmup`` then ``steps`` timed steps of every side, rotating which side goes first;
    every rank starts each step together (a barrier) so one side's skew is not another's."""
    for i in range(1, warmup + steps + 1):
        for side in [*sides[i % len(sides):], *sides[:i % len(sides)]]:
            world.comm.barrier()
            side.step(i, timed=i > warmup)


def rank_results(module: str, n: int, args: argparse.Namespace, passed: Collection[str],
                 env: dict[str, str] | None = None) -> list[Row]:
    """Run ``python -m <module> --worker`` on ``n`` ranks with the options named in ``passed``
    (taken from ``args``); each rank's result, by rank. Raises with the output's tail when a
    rank failed or left no result."""
    from testbed.mpiexec import clean_env, run_mpiexec

    with tempfile.TemporaryDirectory(prefix=f"dtrain-{module.replace('.', '-')}-") as out:
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in passed]
        proc = run_mpiexec(n, [sys.executable, "-m", module, "--worker", "--out", out, *flags],
                           timeout=args.timeout, env=env or clean_env())
        files = sorted(Path(out).glob("rank*.json"))
        if proc.returncode != 0 or len(files) != n:
            raise RuntimeError(f"{module} on {n} ranks failed:\n{proc.stdout[-3000:]}")
        return [json.loads(f.read_text()) for f in files]


def options(args: argparse.Namespace, *, drop: Collection[str] = ()) -> dict[str, Any]:
    """The parsed options as ``run(**options)`` takes them (without the driver-only ones)."""
    return {k: v for k, v in vars(args).items()
            if k not in ("json", "worker", "out", *drop)}


def as_argv(opts: dict[str, Any], *, drop: Collection[str] = ()) -> list[str]:
    """``run(**options)``'s keyword options back as command-line flags for ``parse_args``."""
    return [f"--{k.replace('_', '-')}={v}" for k, v in opts.items() if k not in drop]


def main(args: argparse.Namespace, worker: Callable[[argparse.Namespace], Row],
         run: Callable[..., list[Row]], print_table: Callable[[list[Row]], None]) -> int:
    """A bench's entry point: be the worker when asked, else drive the run and report it."""
    if args.worker:
        return common.save_rank_result(args.out, worker(args))
    return common.report(run(**options(args)), print_table, args.json)
