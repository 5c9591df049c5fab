"""What the members of a group must agree on, and the record of a blamed rank (pure).

MPI and NCCL require every member of a group to run the group's collectives in the same order,
so a collective is identified by its count on the group (`GroupView.collectives`); the
sequence number counts point-to-point operations too, which members need not share (a
pipeline's inner stages send and receive where the outer ones do one of the two). Groups of one
family (``tp[0]``, ``tp[1]``: `family`) run the same program on different ranks, so where the
members of one group disagree, its siblings' histories tell which operation the program runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from launcher.hang.views import GroupView, RankView

P2P = frozenset({"send", "recv", "batch_p2p"})
SEND, RECV = 1, 2   # `GroupView.p2p`: the side a point-to-point operation is named by
#: The kinds of cause, in the order they are told; the first cause is the headline.
KINDS = ("stopped", "exited", "finalizing", "past", "mismatch", "behind", "unsent", "no-record",
         "deadlock")

Member = tuple[RankView, GroupView]
Signature = tuple[str, int]   # an operation as members must agree on it: name, broadcast root


@dataclass(frozen=True)
class Cause:
    """One rank the job waits for, and why it is to blame rather than only waiting itself."""

    rank: int
    kind: str                 # one of KINDS
    label: str                # the group of the operation others wait in for it ("" if none)
    op: str                   # that operation
    seq: int                  # its sequence number, as the waiting ranks count
    waiters: tuple[int, ...]  # the ranks waiting in it for this one
    instead: str = ""         # what this rank did there instead, when known


def family(label: str) -> str:
    """``tp[1]`` -> ``tp``; ``dp[0]#2`` -> ``dp#2``: groups that run the same program."""
    head, _, rest = label.partition("[")
    return head + rest.partition("]")[2]


def signature(op: str, peer: int) -> Signature:
    """Point-to-point operations compare as one kind (pairs differ in which side sends)."""
    return ("p2p", -1) if op in P2P else (op, peer if op == "broadcast" else -1)


def majority(votes: Counter[Signature]) -> Signature | None:
    """The signature most votes name; None on a tie or without votes."""
    top = votes.most_common(2)
    if not top or (len(top) == 2 and top[0][1] == top[1][1]):
        return None
    return top[0][0]


class Groups:
    """Every group's members, as the views hold them; each consensus is counted once (a world
    of thousands asks the same question once per waiting rank)."""

    def __init__(self, views: Sequence[RankView]) -> None:
        self.by_rank = {v.rank: v for v in views}
        self.members: dict[str, dict[int, Member]] = {}
        for v in views:
            for g in v.groups:
                self.members.setdefault(g.label, {})[g.group_rank] = (v, g)
        self._agreed: dict[tuple[str, int], Signature | None] = {}
        self._program: dict[tuple[str, int], tuple[Signature | None, int]] = {}

    def siblings(self, label: str) -> Iterable[Member]:
        """The members of every group of ``label``'s family and size, its own first."""
        size = next(iter(self.members[label].values()))[1].group_size
        yield from self.members[label].values()
        for other, mem in self.members.items():
            if other != label and family(other) == family(label) and \
                    next(iter(mem.values()))[1].group_size == size:
                yield from mem.values()

    def collective(self, g: GroupView, count: int) -> Signature | None:
        entry = g.collective(count)
        return None if entry is None else signature(entry[1], entry[2])

    def consensus(self, label: str, count: int) -> Signature | None:
        """The operation collective ``count`` on ``label`` is: its members' majority, else that
        of the sibling groups too; None while that is still a tie."""
        if (label, count) not in self._agreed:
            self._agreed[label, count] = self._consensus(label, count)
        return self._agreed[label, count]

    def _consensus(self, label: str, count: int) -> Signature | None:
        votes = Counter(s for _, g in self.members[label].values()
                        if (s := self.collective(g, count)))
        agreed = majority(votes)
        if agreed is None and votes:
            votes = Counter(s for _, g in self.siblings(label) if (s := self.collective(g, count)))
            agreed = majority(votes)
        return agreed

    def program(self, label: str, seq: int) -> tuple[Signature | None, int]:
        """The operation at sequence number ``seq`` on ``label``'s family, by the histories that
        reach it, and how many of them name it."""
        if (label, seq) not in self._program:
            votes = Counter(signature(e[1], e[2]) for _, g in self.siblings(label)
                            for e in g.history if e[0] == seq)
            agreed = majority(votes)
            self._program[label, seq] = agreed, votes[agreed] if agreed else 0
        return self._program[label, seq]
