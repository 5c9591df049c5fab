"""The final per-rank exit report printed on the head's stderr (rich table)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TextIO

from launcher.head.outcome import JobOutcome

MAX_ROWS = 64


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def print_report(outcome: JobOutcome, tail: Callable[[int], list[str]], elapsed: float,
                 stream: TextIO) -> None:
    ranks = sorted(outcome.ranks.values(), key=lambda r: r.rank)
    hosts = {r.host for r in ranks}
    code = outcome.exit_code
    if code == 0:
        stream.write(f"dtrain: {_count(len(ranks), 'rank')} on {_count(len(hosts), 'host')} "
                     f"exited 0 in {elapsed:.1f}s\n")
        stream.flush()
        return
    # rich only when there is a table to draw: a clean exit should not pay for the import.
    from rich.console import Console
    from rich.table import Table

    console = Console(file=stream, highlight=False, markup=False, soft_wrap=True)
    shown = [r for r in ranks if r.state != "exited" or r.code != 0]
    if len(ranks) <= MAX_ROWS:
        shown = ranks
    table = Table(title=f"dtrain: job ended with exit code {code} ({outcome.summary})",
                  title_justify="left")
    for col in ("rank", "host", "pid", "state", "code", "status"):
        table.add_column(col)
    for r in shown[:MAX_ROWS]:
        table.add_row(str(r.rank), r.host, str(r.pid or "-"), r.state,
                      "-" if r.code is None else str(r.code), r.describe())
    console.print(table)
    if len(shown) > MAX_ROWS:
        console.print(f"... and {len(shown) - MAX_ROWS} more ranks not shown")
    for f in outcome.failures[:8]:
        console.print(f"failure {f.where}: {f.why}")
    first = next((outcome.ranks[f.rank] for f in outcome.failures if f.rank is not None), None)
    if first is not None and first.error is not None:
        # As torchrun's ChildFailedError: the first failure's exception, from its error file.
        console.print(f"--- root cause: rank {first.rank}@{first.host} raised "
                      f"{first.error.message} ---")
        for line in first.error.lines():
            console.print(line)
    for r in ranks:
        if r is first and r.error is not None:
            continue
        if r.failed or (r.signal and r.state == "exited"):
            lines = tail(r.rank)
            if lines:
                console.print(f"--- last stderr lines of rank {r.rank}@{r.host} ---")
                for line in lines[-10:]:
                    console.print(line)
    console.print(f"elapsed {elapsed:.1f}s")
