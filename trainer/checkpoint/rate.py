"""How fast a save wrote: the seconds it was writing, over all its ranks (`busy`), which its
MB/s is measured over, and what a save reports (`report`, `trainer.checkpoint.save.Save.report`,
``bench/checkpoint_async.py``).
"""

from __future__ import annotations

from typing import Any

_MB = 1e6  # the unit of the reported sizes and rates (dd's)


def busy(writes: list[tuple[float, float]], committed_at: float) -> float:
    """Seconds a save was writing: the union of every rank's write (wall clock: start, end)
    and of the stretch from the last write's end to ``committed_at`` (the agreement that
    every write succeeded, and the commit).

    Not from the first rank's `start`: ranks reach a save apart (the pipeline's stages end
    a step at different times: 10-30 ms at dp 2 x tp 2 x pp 2 on 2 cores), and while no rank
    writes because the late ones are still computing their step, the save has nothing to
    write; that wait is the training's, not the disk's, and dd, the peer its MB/s is held
    to, has none. Staging (a copy in memory) is not writing either. Every moment some rank
    writes counts, and everything from the last write on. ``seconds`` (`Save.report`) keeps
    the whole span, from the first rank's staging."""
    if not writes:
        return 0.0
    spans = sorted([*writes, (max(end for _, end in writes), committed_at)])
    total, reach = 0.0, spans[0][0]
    for start, end in spans:
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total


def report(step: int, gathered: list[Any], commit_s: float, busy_s: float,
           prune_s: float | None) -> dict[str, Any]:
    """What save ``step`` wrote (every rank's record: ``gathered``) and how fast: MB (10^6
    bytes) in all and per rank; ``seconds``: from the first rank's start (its staging) to the
    commit record (``commit_s``), and ``span_mb_s`` over them; ``write_s``: the seconds it
    was writing (``busy_s``, `busy`), and ``mb_s`` over them; MB/s per rank (its write); the
    seconds pruning took after the commit (None: still pruning)."""
    sizes = [sum(r["size"] for r in g["files"].values()) / _MB for g in gathered]
    rates = [mb / g["write_s"] if g["write_s"] > 0 else 0.0
             for mb, g in zip(sizes, gathered, strict=True)]
    mb = sum(sizes)
    return {"step": step, "mb": round(mb, 3), "seconds": round(commit_s, 4),
            "span_mb_s": round(mb / commit_s, 1) if commit_s > 0 else 0.0,
            "write_s": round(busy_s, 4), "mb_s": round(mb / busy_s, 1) if busy_s > 0 else 0.0,
            "prune_s": None if prune_s is None else round(prune_s, 4),
            "rank_mb": [round(mb, 3) for mb in sizes],
            "rank_mb_s": [round(rate, 1) for rate in rates]}
