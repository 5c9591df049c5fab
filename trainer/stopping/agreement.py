"""Every rank stops after the same step: a vote, overlapped with the next step (pure).

A SIGTERM reaches the ranks of a job at slightly different moments, so each rank's own "I was
asked to stop" differs for a while; the step after which they all stop must not. At the end of
every step each rank posts its flag into a non-blocking all-ranks MAX (`Vote.post`) and reads
the vote it posted one step earlier (`Vote.result`). Every rank reads the same vote at the
same step, so all stop after the same step: the first step that ends after the signal has
been seen by some rank at the end of the step before. Waiting for a vote posted a whole step
ago costs nothing (it completed long since), so the check adds one tiny collective per step
and no latency; the price is one more step before stopping.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from trainer.comm.protocol import Vote


class StopAgreement:
    def __init__(self, vote: Vote | None, clock: Callable[[], float] = time.monotonic) -> None:
        """``vote`` None: one rank alone, which decides by itself."""
        self.vote = vote
        self.pending = False
        self._clock = clock
        self._last = clock()
        self.longest = 0.0  # the longest time between two step ends (steps, evals, saves)

    def after(self, step: int, requested: bool) -> bool:
        """At the end of ``step`` on every rank: True when every rank stops now."""
        now = self._clock()
        self.longest, self._last = max(self.longest, now - self._last), now
        if self.vote is None:
            return requested
        if self.pending and self.vote.result():
            self.pending = False
            return True
        self.vote.post(requested)
        self.pending = True
        return False

    def finish(self) -> None:
        """Training ended another way (its last step, --time-limit): read the vote every rank
        posted, so no collective is left behind."""
        if self.pending and self.vote is not None:
            self.vote.result()
        self.pending = False


def reach_seconds(longest_step: float, grace: float) -> float:
    """How long a rank waits, from its SIGTERM, for the ranks to agree on a step before it
    leaves without a checkpoint (a peer gone, or stuck in a collective with one): three of the
    longest step ends seen (the vote is read one step later), at least 1 s, at most half of
    the launcher's grace (the other half is the checkpoint's)."""
    return min(max(3.0 * longest_step, 1.0), max(grace / 2, 0.5))
