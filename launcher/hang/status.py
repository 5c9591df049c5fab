"""The live table of `dtrain launch --status-interval S` (pure: views in, text lines out).

One row per rank (per host once the job has more than `MAX_RANK_ROWS` ranks, so the table
fits a screen): step, average compute time per step, the operation it waits in (``wait``)
or else the last one it entered, with its age, and flags (``STRAGGLER``, ``STOPPED``).
Rendered by rich into plain text of the terminal's width; the head prints each line as its
own ``dtrain:`` notice, so it interleaves cleanly with the ranks' ``[rank@host]`` prefixed output.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

from rich.console import Console
from rich.table import Table

from launcher.hang.views import RankView
from launcher.hang.watch import Straggler

MAX_RANK_ROWS = 32


def render(views: Mapping[int, RankView], slow: Sequence[Straggler], width: int) -> list[str]:
    slow_ranks = {s.rank for s in slow}
    ordered = [views[r] for r in sorted(views)]
    rows = _host_rows(ordered, slow_ranks) if len(ordered) > MAX_RANK_ROWS else [
        _rank_row(v, v.rank in slow_ranks) for v in ordered]
    heads = ("host", "rank", "step", "compute", "operation", "age", "")
    # Every column gets its full width but the operation's, which gives way first.
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(heads)]
    fixed = sum(w for i, w in enumerate(widths) if i != 4) + 2 * (len(heads) - 1)
    widths[4] = max(12, min(widths[4], width - fixed))
    table = Table(box=None, pad_edge=False, show_edge=False)
    for i, head in enumerate(heads):
        table.add_column(head, justify="left" if i in (0, 4, 6) else "right", no_wrap=True,
                         min_width=widths[i], max_width=widths[i], overflow="ellipsis")
    for row in rows:
        table.add_row(*row)
    out = io.StringIO()
    Console(file=out, width=max(40, width), color_system=None, highlight=False).print(table)
    return [line.rstrip() for line in out.getvalue().splitlines()]


def _last(v: RankView) -> tuple[str, str]:
    if not v.groups:
        return ("-", "")
    # What it waits in, if anything; else what it did last.
    g = v.waiting[0] if v.waiting else min(v.groups, key=lambda g: g.age)
    state = " (wait)" if g.in_flight else ""
    return (f"{g.op} #{g.seq} {g.label}{state}", f"{g.age:.1f}s")


def _flags(v: RankView, slow: bool) -> str:
    flags = [v.state.upper()] if v.state not in ("running",) else []
    return " ".join(flags + (["STRAGGLER"] if slow else []))


def _rank_row(v: RankView, slow: bool) -> tuple[str, ...]:
    op, age = _last(v)
    return (v.host, str(v.rank), str(v.step) if v.step else "-",
            f"{v.compute_avg_s:.3f}s" if v.compute_avg_s else "-", op, age, _flags(v, slow))


def _host_rows(views: Sequence[RankView], slow: set[int]) -> list[tuple[str, ...]]:
    by_host: dict[str, list[RankView]] = {}
    for v in views:
        by_host.setdefault(v.host, []).append(v)
    rows: list[tuple[str, ...]] = []
    for host, vs in by_host.items():
        steps = [v.step for v in vs]
        oldest = max(vs, key=lambda v: max((g.age for g in v.waiting), default=-1.0))
        op, age = _last(oldest)
        flags = {f for v in vs for f in _flags(v, v.rank in slow).split()}
        rows.append((host, f"{vs[0].rank}-{vs[-1].rank}", f"{min(steps)}-{max(steps)}",
                     f"{max(v.compute_avg_s for v in vs):.3f}s", op, age, " ".join(sorted(flags))))
    return rows
