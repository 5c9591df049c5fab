"""The shape of a fan-out: which host starts which (pure).

Hosts are numbered 0..n-1 in the plan's order. The head starts hosts 0..K-1 itself; host i
starts hosts K*(i+1) .. K*(i+1)+K-1 (those below n): the heap layout of a K-ary tree, so every
host starts at most K others and the depth is about log_K(n) (Open MPI's radix tree routing
does the same; its default radix is 64). Rank 0's host is the first relay the head starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: `--fanout` left out: flat up to this many hosts (one hop is fastest while the head's own
#: handshakes fit in the time the agents take to boot), else AUTO_FANOUT.
AUTO_FLAT_MAX = 64
AUTO_FANOUT = 32
HEAD = -1  # the head's place in the tree: the parent of the hosts it starts


def choose_fanout(requested: int | None, hosts: int) -> int:
    """The fan-out of a launch on ``hosts`` hosts: ``requested`` (0 = flat) or the default."""
    if requested is not None:
        return requested
    return 0 if hosts <= AUTO_FLAT_MAX else AUTO_FANOUT


@dataclass(frozen=True)
class Tree:
    """A K-ary tree over ``hosts`` hosts; ``fanout`` 0 (or no fewer than ``hosts``) is flat."""

    hosts: int
    fanout: int

    def __post_init__(self) -> None:
        if self.hosts < 0 or self.fanout < 0:
            raise ValueError("a tree needs a non-negative host count and fan-out")

    @property
    def flat(self) -> bool:
        return self.fanout == 0 or self.fanout >= self.hosts

    def children(self, host: int) -> range:
        """The hosts ``host`` starts (HEAD: those the head starts)."""
        if self.flat:
            return range(self.hosts) if host == HEAD else range(0)
        first = self.fanout * (host + 1)
        return range(min(first, self.hosts), min(first + self.fanout, self.hosts))

    def parent(self, host: int) -> int:
        """Who starts ``host``: HEAD or another host."""
        if not 0 <= host < self.hosts:
            raise ValueError(f"host {host} outside 0..{self.hosts - 1}")
        return HEAD if self.flat or host < self.fanout else host // self.fanout - 1

    def subtree(self, host: int) -> list[int]:
        """``host`` and every host below it, in order."""
        out, level = [host], list(self.children(host))
        while level:
            out += level
            level = [c for h in level for c in self.children(h)]
        return sorted(out)

    def depth(self, host: int) -> int:
        """Hops from the head: 1 for a host the head starts."""
        hops = 1
        while (host := self.parent(host)) != HEAD:
            hops += 1
        return hops

    def relays(self) -> list[int]:
        """Hosts that start others."""
        return [h for h in range(self.hosts) if self.children(h)]

    def next_hop(self, host: int, target: int) -> int:
        """The child of ``host`` (HEAD included) whose subtree holds ``target``."""
        hop = target
        while (up := self.parent(hop)) != host:
            if up == HEAD:
                raise ValueError(f"host {target} is not below host {host}")
            hop = up
        return hop

    def describe(self, names: Sequence[str]) -> list[str]:
        """The tree as --dry-run prints it: one line per relay, `name -> children`."""
        if self.flat:
            return [f"fan-out: flat, the head starts all {self.hosts} hosts"]
        lines = [f"fan-out {self.fanout}: {len(self.relays())} relays, depth "
                 f"{max(self.depth(h) for h in range(self.hosts))}",
                 "  head -> " + ", ".join(names[c] for c in self.children(HEAD))]
        for relay in self.relays():
            lines.append(f"  {'  ' * self.depth(relay)}{names[relay]} -> "
                         + ", ".join(names[c] for c in self.children(relay)))
        return lines
