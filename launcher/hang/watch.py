"""When a job counts as hung, and which ranks are stragglers (pure).

Hung: no rank's record advanced (no step reported, no operation entered or completed on any
group) for ``timeout`` seconds while some live rank waits inside an operation. Waiting is
required so that a long phase without communication (a checkpoint every rank writes, a long
evaluation) is not a hang; a rank that stopped while the others wait for it is one. Reported
once per stall: any progress re-arms it.

Straggler: a rank whose average compute time per step (the trainer's moving average, so one
slow step is not enough: `trainer.comm.progress`) exceeds the median of all ranks by
``STRAGGLER_RATIO`` and by at least ``STRAGGLER_MIN_S``, after ``STRAGGLER_MIN_STEPS`` steps.
Compute time excludes time spent waiting in communication, so the ranks that wait for a slow
one do not look slow themselves.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from launcher.hang.views import RankView

STRAGGLER_RATIO = 1.3
STRAGGLER_MIN_S = 0.01
STRAGGLER_MIN_STEPS = 3


class HangClock:
    def __init__(self, timeout: float, now: float) -> None:
        self.timeout = timeout
        self.last_change = now
        self.fired = False
        self._seen: dict[int, object] = {}

    def update(self, views: Mapping[int, RankView], now: float) -> None:
        for rank, v in views.items():
            if self._seen.get(rank) != v.position:
                self._seen[rank] = v.position
                self.last_change, self.fired = now, False

    def stalled_for(self, now: float) -> float:
        return now - self.last_change

    def due(self, views: Mapping[int, RankView], now: float) -> bool:
        """True once per stall: nothing advanced for ``timeout`` and a live rank waits."""
        if self.fired or now - self.last_change < self.timeout:
            return False
        return any(v.waiting for v in views.values() if v.state in ("running", "stopped"))


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    compute_s: float
    median_s: float

    def describe(self) -> str:
        return (f"rank {self.rank} ({self.host}) computes {self.compute_s:.3f}s per step, "
                f"{self.compute_s / self.median_s:.1f}x the median {self.median_s:.3f}s")


def stragglers(views: Mapping[int, RankView]) -> list[Straggler]:
    timed = [v for v in views.values() if v.step >= STRAGGLER_MIN_STEPS and v.compute_avg_s > 0]
    if len(timed) < 2:
        return []
    median = statistics.median(v.compute_avg_s for v in timed)
    limit = max(median * STRAGGLER_RATIO, median + STRAGGLER_MIN_S)
    return [Straggler(v.rank, v.host, v.compute_avg_s, median)
            for v in sorted(timed, key=lambda v: v.rank) if v.compute_avg_s > limit]
