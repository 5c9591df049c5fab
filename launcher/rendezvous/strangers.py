"""Connections to the rendezvous port that proved no token, counted by address, and the few
lines the head prints about them (pure).

Anyone who reaches the port can connect as often as they like, so what the head says about it
is bounded: one line the first time an address fails, then at most one per address every
INTERVAL_S with the count since, and at most LINES_PER_INTERVAL such lines in all (then one
line saying the rest are only counted). At the rendezvous timeout `agents` names the
addresses where a dtrain agent failed the token or spoke another version: the usual reason a
node that was started never joined.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.errors import listed

INTERVAL_S = 60.0
LINES_PER_INTERVAL = 10
ADDRESSES_MAX = 4096     # addresses told apart; beyond, they are counted as one
_OTHERS = "other addresses"


@dataclass
class _Address:
    count: int = 0                 # connections from it that proved no token
    unshown: int = 0               # of those, how many no line has counted yet
    shown_at: float | None = None  # when its last line was printed
    agents: int = 0                # of those, a dtrain agent with another token or version


class Strangers:
    def __init__(self, interval: float = INTERVAL_S, lines: int = LINES_PER_INTERVAL) -> None:
        self._interval, self._lines = interval, lines
        self._seen: dict[str, _Address] = {}
        self._window = float("-inf")  # when the current interval began
        self._printed = 0             # lines printed in it
        self._muted = False           # the line that says the rest are counted was printed

    def note(self, address: str, why: str, now: float, *, agent: bool = False) -> str | None:
        """Count a connection from ``address`` that was dropped because ``why`` (``agent``: it
        was a dtrain agent that failed the token or the version); the line to print, if any."""
        if address not in self._seen and len(self._seen) >= ADDRESSES_MAX:
            address = _OTHERS
        seen = self._seen.setdefault(address, _Address())
        seen.count += 1
        seen.unshown += 1
        seen.agents += agent
        if seen.shown_at is not None and now - seen.shown_at < self._interval:
            return None
        if now - self._window >= self._interval:
            self._window, self._printed, self._muted = now, 0, False
        if self._printed >= self._lines:
            if self._muted:
                return None
            self._muted = True
            return (f"more connections that prove no token arrive; they are counted, not "
                    f"shown, for up to {self._interval:g}s")
        self._printed += 1
        seen.shown_at, count, seen.unshown = now, seen.unshown, 0
        if count == seen.count:
            head = "a connection" if count == 1 else f"{count} connections"
        else:
            head = f"{count} more connections ({seen.count} in all)"
        return f"ignored {head} from {address}: {why}; the rendezvous goes on"

    def agents(self, most: int = 8) -> str:
        """The addresses where an agent failed the token, most attempts first ("" if none)."""
        failed = sorted(((s.agents, a) for a, s in self._seen.items() if s.agents),
                        key=lambda pair: (-pair[0], pair[1]))
        return listed([f"{a} ({n}x)" for n, a in failed], most)
