"""When a job counts as hung, and which ranks are stragglers (pure).

Hung: no rank's record advanced (no step reported, no operation entered or completed on any
group) and no rank outside communication worked (used `BUSY_SHARE` of a core or more) for
``timeout`` seconds, while some live rank waits inside an operation. Waiting is required so
that a long phase without communication that every rank goes through (a long evaluation) is
not a hang; working is counted so that one rank's long phase while the others wait for it
(rank 0 writing a checkpoint the others do not write, a slower compile, data preparation, a
long first step, a straggler) is not one either. A rank that stopped, sleeps, or blocks
outside communication while the others wait for it is a hang; so is every rank waiting
(ranks inside an operation do not count as working: MPI spins while it waits; torch.distributed
ranks, seen through the Flight Recorder, do: gloo blocks while it waits, so a rank inside a long
collective that uses its CPU moves data). Reported once
per stall: any progress re-arms it. A rank that computes forever outside communication is
not reported (its step stands still in the live view). A program that keeps no record at all
(`blind`: neither dtrain's trainer, torch.distributed nor an MPI rank in a PMI barrier) counts
as hung when none of its ranks advanced or worked for ``timeout``: every rank sleeps or blocks
(on a file, a socket, a lock); its diagnosis is the ranks' stacks.

Straggler: a rank whose average compute time per step (the trainer's moving average, so one
slow step is not enough: `trainer.comm.progress`) exceeds the median of all ranks by
``STRAGGLER_RATIO`` and by at least ``STRAGGLER_MIN_S``, after ``STRAGGLER_MIN_STEPS`` steps.
Compute time excludes time spent waiting in communication, so the ranks that wait for a slow
one do not look slow themselves.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from launcher.hang.views import RankView

BUSY_SHARE = 0.05   # of a core: computing, even starved on a loaded host; a sleeper uses ~0
STRAGGLER_RATIO = 1.3
STRAGGLER_MIN_S = 0.01
STRAGGLER_MIN_STEPS = 3


#: How often `HangClock.update` looks at every rank's view. The supervisor calls it once per
#: event (each frame from any host), so looking each time cost O(ranks) per frame: at 1,024
#: hosts x 8 ranks, three quarters of the head's CPU (bench.sim_scale). Views arrive once a
#: second per host, so a look every `SCAN_S` misses nothing; `due` looks again before it
#: says a job hung, so a stall is never reported from a stale look.
SCAN_S = 0.1


class HangClock:
    def __init__(self, timeout: float, now: float) -> None:
        self.timeout = timeout
        self.last_change = now
        self.fired = False
        self._seen: dict[int, object] = {}
        self._next_scan = now

    def update(self, views: Mapping[int, RankView], now: float,
               fresh: set[int] | None = None) -> None:
        """Look at the views (at most every `SCAN_S`): at those of ``fresh``, the ranks whose
        views arrived since the last look (emptied by this look), or at all when None. A
        view that did not arrive again says nothing new: a working rank's next view (one per
        progress interval) holds the clock again, and `due` looks at all of them before it
        fires. At 1,024 hosts x 8 ranks a look at every view ten times a second was a
        quarter of the head's CPU (bench.sim_scale's profile)."""
        if now >= self._next_scan:
            self._next_scan = now + SCAN_S
            if fresh is None:
                self._scan(views, now)
            else:
                self._scan({r: views[r] for r in fresh if r in views}, now)
                fresh.clear()

    def _scan(self, views: Mapping[int, RankView], now: float) -> None:
        for rank, v in views.items():
            # MPI spins while it waits: a waiting rank's CPU is work only where waiting
            # blocks (torch.distributed's ranks: a long collective moving data is progress).
            working = v.state in ("running", "no-record") and (
                v.cpu_share >= BUSY_SHARE or v.runnable) and (
                not v.waiting or v.recorder == "flight")
            if self._seen.get(rank) != v.position or working:
                self._seen[rank] = v.position
                self.last_change, self.fired = now, False

    def stalled_for(self, now: float) -> float:
        return now - self.last_change

    def due(self, views: Mapping[int, RankView], now: float) -> bool:
        """True once per stall: nothing advanced or worked for ``timeout`` and a live rank
        waits."""
        if self.fired or now - self.last_change < self.timeout:
            return False
        self._scan(views, now)  # the last look may be up to SCAN_S old: look again first
        if now - self.last_change < self.timeout:
            return False
        live = [v for v in views.values() if v.state in ("running", "stopped", "no-record")]
        return any(v.waiting for v in live) or blind(views.values())


def blind(views: Iterable[RankView]) -> bool:
    """No live rank keeps a record of its communication (neither dtrain's trainer nor
    torch.distributed's Flight Recorder) and none is in a PMI barrier: a program dtrain cannot
    see into, whose hang only the ranks' stacks can tell (stack-only diagnosis)."""
    live = [v for v in views if v.state in ("running", "stopped", "no-record")]
    return bool(live) and all(not v.groups and v.fence_age is None for v in live)


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
