"""When to say that a PMI barrier is stalled: once per interval, the one timer both the agents
and the head use (pure).

A barrier (MPI_Init's wire-up, or a fence) that some ranks entered and others have not after
``--pmi-stall`` seconds is reported, then again every interval while it stays stuck. A new
barrier (another ``key``) starts the count again, so a job that moves on is never reported
for time spent in an earlier barrier.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence, Set


class StallClock:
    """``due(now, key)``: the seconds waited when a report is due now, else None. ``key`` names
    the stalled barrier (None: nothing is stalled, which resets the clock)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._key: Hashable = None
        self._since = 0.0
        self._reported = 0.0

    def due(self, now: float, key: Hashable) -> float | None:
        if key is None:
            self._key = None
            return None
        if key != self._key:
            self._key, self._since, self._reported = key, now, 0.0
        waited = now - self._since
        if waited >= self.interval and waited - self._reported >= self.interval:
            self._reported = waited
            return waited
        return None


def holding_up(ranks: Set[int], in_barrier: Set[int], spoke: Set[int], left_silent: Set[int],
               *, host_waited: bool) -> tuple[list[int], list[int]]:
    """One host's ranks holding up a barrier, and those of them that left without a PMI word
    (exited before MPI_Init: they will never come).

    Alone, a host counts a barrier some local rank entered or an MPI_Init some local rank
    began; with ``host_waited`` (the head's barrier waits for this host) any barrier counts.
    Local ranks that never spoke are named first: MPICH ranks that began MPI_Init wait for
    them in node-local shared-memory set-up, where PMI sees nothing.
    """
    if not (in_barrier or spoke or host_waited):
        return [], []
    silent = ranks - spoke
    missing = silent if silent and spoke else ranks - in_barrier
    return sorted(missing), sorted(missing & left_silent)


def stall_text(waited: float, missing: Sequence[tuple[int, str]],
               gone: Sequence[tuple[int, str]], silent_hosts: Sequence[str] = ()) -> str:
    """The one line a stalled barrier prints: which ranks (rank@host) it waits for and which of
    them already exited without calling MPI_Init (they will never come)."""
    names = ", ".join(f"{rank}@{host}" for rank, host in missing) or "none known"
    text = f"PMI barrier (MPI_Init or a fence) has waited {waited:.0f}s for ranks {names}"
    if gone:
        text += ("; exited without calling MPI_Init: "
                 + ", ".join(f"{rank}@{host}" for rank, host in gone)
                 + " (every rank of an MPI job must call MPI_Init)")
    if silent_hosts:
        text += f"; no answer from hosts {', '.join(silent_hosts)}"
    return text
