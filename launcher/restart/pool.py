"""The hosts of each round: active hosts in node order, spares, blame counts, exclusion (pure).

Spares are the hosts marked ``spare`` in the hostfile, or the last `--spares K` of the host
list; they are connected and checked at start but run no ranks until one takes a place. A
spare whose agent is gone (not reached at start, fallen silent, its stream broken) stays a
spare: it is taken only when no spare with a live agent fits, and connected again then (a
stall under load passes, a cut link is mended), so the job never ends for want of a spare that
was not tried. A spare whose check of the job failed (its working directory or program is
missing) takes no place.

After a failure (`launcher.restart.blame`), every blamed host counts one blame; a host blamed
twice (`--exclude-after`, 0: never) is excluded from the job for good. A host that must leave
(lost, hung, reported an error, or excluded) is replaced, in its node position (so the ranks
keep their numbers), by a spare with at least as many slots (the fewest that suffice; its first
N slots are used); one that left without being excluded becomes the last spare (connected
again when its turn comes: a cut link may be back, a hang may have been a passing one). Without
such a spare:

* with `--min-nodes M` the job goes on without the host while at least M hosts remain (the
  ranks are renumbered; the program learns the smaller world from the usual variables);
* otherwise a host that is not excluded stays (a lost one is connected again: it may be back);
* otherwise the job ends, naming the host.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from launcher.errors import UsageError
from launcher.hosts.selection import HostSlots
from launcher.restart.blame import Blame


@dataclass(frozen=True)
class NextRound:
    """Where the next round runs, and how it differs from the last."""

    hosts: tuple[HostSlots, ...]
    """The hosts of the round, in node order."""
    replaced: tuple[tuple[str, str], ...] = ()
    """(host that left, spare in its place)."""
    dropped: tuple[str, ...] = ()
    """Hosts left out without a replacement (--min-nodes)."""
    kept: tuple[str, ...] = ()
    """Hosts that should have left but stay for want of a spare (a lost one reconnected)."""

    def describe(self) -> str:
        parts = [f"{new} replaces {old}" for old, new in self.replaced]
        if self.dropped:
            parts.append(f"continuing without {', '.join(self.dropped)} (--min-nodes)")
        if self.kept:
            parts.append(f"{', '.join(self.kept)} used again (no spare left)")
        return "; ".join(parts) or "same hosts"


@dataclass(frozen=True)
class JobEnds:
    """No round can follow: why, naming the host."""

    why: str


def split_spares(selected: Sequence[HostSlots], spares: int) -> tuple[list[HostSlots],
                                                                     list[HostSlots]]:
    """(active hosts, spares): the hosts marked spare, then the last ``spares`` of the rest."""
    marked = [h for h in selected if h.entry.spare]
    active = [h for h in selected if not h.entry.spare]
    if spares:
        if spares >= len(active):
            raise UsageError("no host left to run on", f"--spares {spares}",
                             f"only {len(active)} host(s) are not spares",
                             "Give fewer spares than hosts")
        marked = [*active[-spares:], *marked]
        active = active[:-spares]
    if not active:
        raise UsageError("no host left to run on", marked[0].entry.source or "hosts",
                         "every host is marked spare", "Mark only the stand-by hosts spare")
    return active, marked


class HostPool:
    def __init__(self, active: Sequence[HostSlots], spares: Sequence[HostSlots], *,
                 min_nodes: int | None = None, exclude_after: int = 2) -> None:
        if min_nodes is not None and min_nodes > len(active):
            raise UsageError("--min-nodes above the job's hosts", f"--min-nodes {min_nodes}",
                             f"the job starts on {len(active)} host(s)",
                             f"Give at most {len(active)}")
        self.active = list(active)
        self.spares = list(spares)
        self.min_nodes = min_nodes
        self.exclude_after = exclude_after
        self.blamed: Counter[str] = Counter()
        self.excluded: set[str] = set()
        self.gone: set[str] = set()  # spares whose agent is gone: taken last, reconnected

    def is_spare(self, name: str) -> bool:
        return any(s.entry.name == name for s in self.spares)

    def lose_spare(self, name: str) -> None:
        """A spare's agent is gone (silent, stream broken): used last, connected again."""
        if self.is_spare(name):
            self.gone.add(name)

    def spare_back(self, name: str) -> None:
        """The spare's agent is connected again."""
        self.gone.discard(name)

    def refuse_spare(self, name: str) -> bool:
        """A spare's check of the job failed: it can take no place."""
        before = len(self.spares)
        self.spares = [s for s in self.spares if s.entry.name != name]
        return len(self.spares) < before

    def next_round(self, blame: Blame) -> NextRound | JobEnds:
        """Count the blame and place the next round (see the module docstring)."""
        for name in blame.hosts:
            self.blamed[name] += 1
            if self.exclude_after and self.blamed[name] >= self.exclude_after:
                self.excluded.add(name)
        hosts, rejoining = list(self.active), []
        replaced: list[tuple[str, str]] = []
        dropped: list[str] = []
        kept: list[str] = []
        for host in self.active:
            name = host.entry.name
            if name not in blame.leave and name not in self.excluded:
                continue
            spare = self._take_spare(len(host.slots))
            if spare is not None:
                hosts[hosts.index(host)] = spare
                replaced.append((name, spare.entry.name))
            elif self.min_nodes is not None and len(hosts) - 1 >= self.min_nodes:
                hosts.remove(host)
                dropped.append(name)
            elif name not in self.excluded:
                kept.append(name)
                continue
            else:
                return JobEnds(self._no_place(host, blame))
            if name not in self.excluded:
                rejoining.append(host)
        self.active = hosts
        self.spares += rejoining
        return NextRound(tuple(hosts), tuple(replaced), tuple(dropped), tuple(kept))

    def _take_spare(self, slots: int) -> HostSlots | None:
        fits = [s for s in self.spares if len(s.slots) >= slots
                and s.entry.name not in self.excluded]
        if not fits:
            return None
        # Spares never used first (a host that left is the last resort), then those with a live
        # agent (one that is gone is connected again), the fewest slots first.
        spare = min(fits, key=lambda s: (s.entry.name in self.blamed, s.entry.name in self.gone,
                                         len(s.slots)))
        self.spares.remove(spare)
        return replace(spare, slots=spare.slots[:slots])

    def _no_place(self, host: HostSlots, blame: Blame) -> str:
        name = host.entry.name
        floor = (f"--min-nodes {self.min_nodes} allows no fewer than the "
                 f"{len(self.active)} host(s) left" if self.min_nodes is not None
                 else "no --min-nodes lets the job go on without it")
        return (f"host {name} was blamed {self.blamed[name]} times (last: {blame.cause}, "
                f"{blame.detail}) and is not used again; no spare with {len(host.slots)} "
                f"slot(s) is left and {floor}. Add spare hosts (`spare` in the hostfile, or "
                "--spares K) or lower --min-nodes")
