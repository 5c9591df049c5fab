"""Which ranks a hung job waits for, and which of them are causes rather than consequences (pure).

For the collective that a rank waits in on group G (lined up by its count, `launcher.hang.model`),
each other member of G is

    joined    it entered that collective as the same operation (and root, for a broadcast);
              a joined member that is stopped is still needed: the collective cannot finish
              while it does not run (likewise a stopped peer that posted its point-to-point part)
    behind    it has entered fewer collectives on G
    past      it entered that collective as another operation, which returned (a broadcast it
              roots), and went on; or it went on beyond what its history holds, past an
              operation that needs every member (a broadcast's root may leave first)
    mismatch  it waits in that collective as another operation

"The" operation is the one most members entered there; a tie (a group of two) is decided by the
sibling groups of the same family while their histories reach back to it. A rank that is itself
the odd one out waits for nobody: it is the cause. A rank waiting in a point-to-point operation
needs its peer to have posted one on the group too (two plain receives from each other: both).

Causes: a member past or mismatched (its program went another way: it skipped an operation or
ran a different one), a running sender whose posted send never reaches the receiver that waits
in the matching receive (``unsent``: both halves are posted, so what is stuck is below the
program, on the sender's side), and a needed rank that waits in nothing (computing or blocked
outside communication, stopped, exited, without a progress record). A needed rank that itself waits
elsewhere explains the wait by its own: a consequence, and the chain of who waits for whom is
followed across groups to its end (the "wavefront" of NVIDIA's flight-recorder attribution).
A stopped rank is always a cause. Chains that close in a cycle with no cause are judged by
`launcher.hang.cycles`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from launcher.hang.cycles import break_cycle, stuck_cycles
from launcher.hang.graph import explained_by, reachable, reverse
from launcher.hang.model import KINDS, P2P, RECV, SEND, Cause, Groups, Signature
from launcher.hang.views import GroupView, RankView


@dataclass(frozen=True)
class Analysis:
    causes: tuple[Cause, ...]                  # the headline's first
    needs: Mapping[int, tuple[int, ...]]       # waiting rank -> the ranks it waits for
    explained: frozenset[int]                  # waiting ranks whose chains end at a cause


def analyse(views: Sequence[RankView]) -> Analysis:
    groups = Groups(views)
    causes: dict[int, Cause] = {}
    needs: dict[int, set[int]] = {}
    edges: dict[tuple[int, int], GroupView] = {}   # (waiter, needed) -> the waiter's op
    # Ranks the others cannot see in their groups: no record yet, or gone without one.
    unseen = [v.rank for v in views if v.state == "no-record" or
              (v.state == "exited" and not v.groups)]
    judged: dict[tuple[str, int, Signature | None], list[tuple[int, Cause | None]]] = {}
    for v in views:
        # A stopped rank's waits count too: continued, it would still wait for them.
        for g in v.waiting if v.state in ("running", "stopped") else ():
            for need, deviant in _needed(groups, v, g, unseen, judged):
                if deviant is not None:
                    causes.setdefault(need, deviant)
                if need != v.rank:
                    needs.setdefault(v.rank, set()).add(need)
                    edges.setdefault((v.rank, need), g)
    for (_, need), g in edges.items():
        idle = need not in groups.by_rank or groups.by_rank[need].state != "running" or \
            not groups.by_rank[need].waiting
        if need not in causes and idle:
            causes[need] = Cause(need, "behind", g.label, g.op, g.seq, ())
    for v in views:
        if v.state == "stopped" and v.rank not in causes:
            w = v.waiting[0] if v.waiting else None
            causes[v.rank] = Cause(v.rank, "stopped", w.label if w else "", w.op if w else "",
                                   w.seq if w else 0, ())
    explained = explained_by(needs, set(causes))
    for _ in range(len(needs)):
        cycles = stuck_cycles(needs, explained, set(causes))
        for cycle in cycles:
            for cause in break_cycle(groups, cycle, edges):
                causes.setdefault(cause.rank, cause)
        explained = explained_by(needs, set(causes))
        if not cycles:
            break
    back = reverse(needs)
    told = sorted((_as_told(c, groups, edges, set(causes)) for c in causes.values()),
                  key=lambda c: (KINDS.index(c.kind), -len(reachable(back, c.rank)), c.rank))
    return Analysis(tuple(told), {r: tuple(sorted(n)) for r, n in needs.items()},
                    frozenset(explained))


def _as_told(c: Cause, groups: Groups, edges: Mapping[tuple[int, int], GroupView],
             causes: set[int]) -> Cause:
    """A stopped or exited rank is told as such whatever it did; waiters that are not causes
    themselves are the ones named."""
    v = groups.by_rank.get(c.rank)
    state = v.state if v is not None else "no-record"
    waiters = tuple(sorted(w for (w, n), g in edges.items()
                           if n == c.rank and w not in causes and g.label == c.label))
    return replace(c, kind=c.kind if state == "running" else state,
                   waiters=c.waiters if c.kind == "deadlock" else waiters or c.waiters)


def _needed(groups: Groups, v: RankView, g: GroupView, unseen: list[int],
            judged: dict[tuple[str, int, Signature | None], list[tuple[int, Cause | None]]],
            ) -> list[tuple[int, Cause | None]]:
    """The ranks ``v``'s operation ``g`` waits for, with a Cause for those that deviate; ``v``
    itself, with its Cause, when it is the one in the wrong operation. The members of a group
    are judged once per collective and operation (``judged``): a world of thousands waiting in
    one all-reduce costs one pass over them, not one per waiting rank."""
    mem = groups.members[g.label]
    if g.op in P2P:
        if g.peer not in mem:
            return []
        peer, pg = mem[g.peer]
        posted = pg.in_flight and pg.op in P2P and peer.state != "stopped"
        if posted and v.state == "running" and g.p2p == RECV and pg.p2p == SEND \
                and pg.peer == g.group_rank:
            # Both halves are posted and both ranks run, yet nothing arrives: the transfer is
            # stuck on the sender's side (its link, or the transport under it). A stopped
            # receiver is the reason by itself: its sender only waits for it.
            return [(peer.rank, Cause(peer.rank, "unsent", g.label, pg.op, pg.seq, ()))]
        mutual = g.op == pg.op == "recv" and pg.peer == g.group_rank
        return [] if posted and not mutual else [(peer.rank, None)]
    count = g.collectives
    mine = groups.collective(g, count)
    agreed = groups.consensus(g.label, count)
    if agreed is not None and mine != agreed:
        seq = next((e[0] for _, mg in mem.values() if groups.collective(mg, count) == agreed
                    and (e := mg.collective(count))), g.seq)
        return [(v.rank, Cause(v.rank, "mismatch", g.label, agreed[0], seq, (),
                               f"{g.op} #{g.seq}"))]
    key = (g.label, count, mine)
    if key not in judged:
        judged[key] = _judge(groups, g, count, agreed or mine, unseen)
    return [(r, cause) for r, cause in judged[key] if r != v.rank]


def _judge(groups: Groups, g: GroupView, count: int, reference: Signature | None,
           unseen: list[int]) -> list[tuple[int, Cause | None]]:
    """The members of ``g``'s group that have not joined its collective ``count`` as
    ``reference``, with a Cause for those that deviate."""
    found: list[tuple[int, Cause | None]] = []
    for grank, (m, mg) in groups.members[g.label].items():
        theirs = groups.collective(mg, count)
        if mg.collectives < count:
            found.append((m.rank, None))
        elif theirs is None:
            if reference != ("broadcast", grank):  # a broadcast's root may leave first
                found.append((m.rank, _deviant(m, mg, g, count, "past")))
        elif theirs != reference:
            entry = mg.collective(count)
            kind = "mismatch" if mg.in_flight and entry and entry[0] == mg.seq else "past"
            found.append((m.rank, _deviant(m, mg, g, count, kind)))
        elif m.state == "stopped" and mg.in_flight and mg.collectives == count:
            found.append((m.rank, None))  # it joined, but a stopped member never completes it
    found += [(r, None) for r in unseen if len(groups.members[g.label]) < g.group_size]
    return found


def _deviant(m: RankView, mg: GroupView, g: GroupView, count: int, kind: str) -> Cause:
    entry = mg.collective(count)
    instead = ""
    if entry is not None:
        seq, op, peer = entry
        instead = f"{op} #{seq}" + (f" (root {peer})" if op == "broadcast" else "")
    return Cause(m.rank, kind, g.label, g.op, g.seq, (), instead)
