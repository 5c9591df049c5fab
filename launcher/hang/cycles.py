"""Cycles of waits with no cause in them, and which of their ranks broke the program (pure).

When ranks wait for each other in a circle, each in a group where the next has not arrived, no
single wait names a cause: this is what a skipped operation leaves once later operations of the
same kind matched one off (MPI matches each kind in call order), or once the skipping rank's next
operation on the group was a point-to-point one the others never post. Two rules, tried in turn,
pick the rank of the cycle whose program went another way:

1. History: groups of one family run the same operation at each sequence number; a rank of the
   cycle whose history has another operation at a sequence number where at least two others of
   the family agree (and are the majority) deviated there: a mismatch if it is still in that
   operation, past it otherwise.
2. Conflicts: one program brings its ranks to prefixes of itself, so of two ranks one has
   entered at least as many operations as the other on every family of groups, and two ranks
   waiting in one collective (the same point of the program) have entered as many. The rank of
   the cycle in conflict with the most others, if one is, skipped an operation (behind, on the
   group where a rank of the cycle waits for it) or added one (past). Pipelines whose inner
   stages run more point-to-point operations than the outer ones break this rule; it is only
   asked where nothing else explains a cycle.

A cycle neither rule breaks is a deadlock, blamed on every rank in it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from launcher.hang.graph import components
from launcher.hang.model import P2P, Cause, Groups, family, signature
from launcher.hang.views import GroupView

Edges = Mapping[tuple[int, int], GroupView]   # (waiter, waited for) -> the waiter's operation


def stuck_cycles(needs: Mapping[int, set[int]], explained: set[int],
                 causes: set[int]) -> list[frozenset[int]]:
    """The cycles that unexplained waits end in: strongly connected sets of two ranks or more
    with no wait leading out of them."""
    stuck = {w for w in needs if w not in explained and w not in causes}
    out: list[frozenset[int]] = []
    for component in components({w: needs[w] & stuck for w in stuck}):
        leaves = any(n not in component for w in component for n in needs[w])
        if len(component) > 1 and not leaves:
            out.append(frozenset(component))
    return out


def break_cycle(groups: Groups, cycle: frozenset[int], edges: Edges) -> list[Cause]:
    return _by_history(groups, cycle, edges) or _by_conflicts(groups, cycle, edges) or \
        _deadlock(cycle, edges)


def _by_history(groups: Groups, cycle: frozenset[int], edges: Edges) -> list[Cause]:
    found = []
    for rank in sorted(cycle):
        for g in groups.by_rank[rank].groups:
            odd = next(((seq, op, peer) for seq, op, peer, _ in g.history
                        if _deviates(groups, g.label, seq, signature(op, peer))), None)
            if odd is None:
                continue
            seq, op, peer = odd
            agreed, _ = groups.program(g.label, seq)
            waiting = [(m.rank, mg.op) for m, mg in groups.members[g.label].values()
                       if mg.in_flight and mg.seq == seq and m.rank != rank]
            name = waiting[0][1] if waiting else agreed[0] if agreed else ""
            kind = "mismatch" if g.in_flight and g.seq == seq else "past"
            found.append(Cause(rank, kind, g.label, name, seq, tuple(r for r, _ in waiting),
                               _entry(op, seq, peer)))
            break
    return found


def _deviates(groups: Groups, label: str, seq: int, mine: tuple[str, int]) -> bool:
    agreed, votes = groups.program(label, seq)
    return agreed is not None and agreed != mine and votes >= 2


def _entry(op: str, seq: int, peer: int) -> str:
    return f"{op} #{seq}" + (f" (root {peer})" if op == "broadcast" else "")


def _by_conflicts(groups: Groups, cycle: frozenset[int], edges: Edges) -> list[Cause]:
    """The rank of ``cycle`` in conflict with the most ranks of the job, if one is: two ranks
    conflict when neither has entered at least as many operations on every family of groups as
    the other (one program's prefixes are ordered), or when both wait in one collective (the
    same point of the program) with different counts."""
    counts = {v.rank: {family(g.label): g.seq for g in v.groups}
              for v in groups.by_rank.values() if v.groups}
    point = {v.rank: (g.label, g.collectives) for v in groups.by_rank.values()
             for g in v.waiting[:1] if g.op not in P2P}
    conflicts: Counter[int] = Counter()
    for a in sorted(cycle & counts.keys()):
        for b, theirs in counts.items():
            shared = counts[a].keys() & theirs.keys()
            less = any(counts[a][f] < theirs[f] for f in shared)
            more = any(counts[a][f] > theirs[f] for f in shared)
            together = a in point and point.get(b) == point[a]
            conflicts[a] += (less and more) or (together and (less or more))
    ranked = [(n, r) for r, n in conflicts.most_common() if n]
    if not ranked or (len(ranked) > 1 and ranked[1][0] == ranked[0][0]):
        return []
    rank = ranked[0][1]
    waited = sorted((w, g) for (w, n), g in edges.items() if n == rank and w in cycle)
    if not waited:
        return []
    g = waited[0][1]
    mine = next(mg for mg in groups.by_rank[rank].groups if mg.label == g.label)
    usual = Counter(c.get(family(g.label)) for r, c in counts.items() if r != rank).most_common(1)
    kind = "behind" if usual and usual[0][0] is not None and mine.seq < usual[0][0] else "past"
    return [Cause(rank, kind, g.label, g.op, g.seq, tuple(w for w, _ in waited),
                  f"{mine.seq} operations on {g.label}, in conflict with the counts of "
                  f"{ranked[0][0]} other ranks (the same program cannot have brought them "
                  "there)")]


def _deadlock(cycle: frozenset[int], edges: Edges) -> list[Cause]:
    out = []
    for rank in sorted(cycle):
        mine = next((g for (w, n), g in edges.items() if w == rank and n in cycle), None)
        waiters = tuple(sorted(w for (w, n) in edges if n == rank and w in cycle))
        out.append(Cause(rank, "deadlock", mine.label if mine else "", mine.op if mine else "",
                         mine.seq if mine else 0, waiters))
    return out
