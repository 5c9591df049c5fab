"""How fast a save wrote: the seconds it was writing, over all its ranks (`busy`), which its
MB/s is measured over (`trainer.checkpoint.save.Save.report`, ``bench/checkpoint_async.py``).
"""

from __future__ import annotations


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
