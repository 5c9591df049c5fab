"""Which rank holds a hung job up, in which operation, on which group (pure).

Input: every rank's view (`launcher.hang.views`) and the Python stacks the agents could take.
Members of one group share its label (``dp[1]``) and count its operations alike, so a
collective in which some members wait at sequence number ``s`` while others have entered fewer
than ``s`` operations names the latter: they *never entered* ``op #s`` on that group. A rank
waiting in a point-to-point receive names its peer. Each named rank is then described: stopped
(SIGSTOP), exited, waiting elsewhere, or in no operation at all (computing or blocked outside
communication), with its stack when one was taken. A stopped rank is always named.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from launcher.hang.views import GroupView, RankView

_RECV = 2


@dataclass(frozen=True)
class Diagnosis:
    culprits: tuple[int, ...]   # the ranks the job waits for
    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def who(ranks: Iterable[int], views: Mapping[int, RankView]) -> str:
    """``rank 2 (node2)`` or ``ranks 0, 1 (node1), 3 (node2)``: ranks grouped by host."""
    ordered = sorted(set(ranks))
    by_host: dict[str, list[int]] = {}
    for r in ordered:
        by_host.setdefault(views[r].host if r in views else "?", []).append(r)
    parts = [f"{', '.join(map(str, rs))} ({host})" for host, rs in by_host.items()]
    return f"{'rank' if len(ordered) == 1 else 'ranks'} {', '.join(parts)}"


def diagnose(views: Sequence[RankView], stacks: Mapping[int, str] | None = None) -> Diagnosis:
    by_rank = {v.rank: v for v in views}
    members: dict[str, dict[int, tuple[RankView, GroupView]]] = {}
    for v in views:
        for g in v.groups:
            members.setdefault(g.label, {})[g.group_rank] = (v, g)
    lines: list[str] = []
    culprits: list[int] = []
    for label in sorted(members):
        found = _collective_findings(label, members[label], by_rank)
        for text, missing in found:
            lines.append(text)
            culprits += [r for r in missing if r not in culprits]
    for text, peer in _p2p_findings(views, members, by_rank):
        lines.append(text)
        if peer not in culprits:
            culprits.append(peer)
    if not lines:
        lines.append(_nobody_missing(views, by_rank))
    # A stopped rank holds the job up whatever it was doing when stopped: one stopped inside
    # a receive from a running peer names that peer above, and must be named itself too.
    culprits += [v.rank for v in views if v.state == "stopped" and v.rank not in culprits]
    for r in culprits:
        lines.append(f"  {who([r], by_rank)}: {_describe(by_rank[r])}")
    for r in (culprits or sorted(by_rank)):
        if stacks and stacks.get(r):
            lines.append(f"  stack of rank {r} (pid {by_rank[r].pid}):")
            lines += [f"    {s}" for s in stacks[r].rstrip().splitlines()]
    return Diagnosis(tuple(culprits), tuple(lines))


def _collective_findings(label: str, mem: Mapping[int, tuple[RankView, GroupView]],
                         by_rank: Mapping[int, RankView]) -> list[tuple[str, list[int]]]:
    found = []
    seqs = sorted({g.seq for _, g in mem.values() if g.in_flight and g.p2p == 0})
    for s in seqs:
        waiting = [v.rank for v, g in mem.values() if g.in_flight and g.seq == s and g.p2p == 0]
        missing = sorted(v.rank for v, g in mem.values() if g.seq < s)
        size = next(iter(mem.values()))[1].group_size
        unseen = size - len(mem)
        if not missing and not unseen:
            continue
        g = next(g for v, g in mem.values() if v.rank == waiting[0])
        what = f"{g.op} #{s} on {label}{_payload(g)}"
        parts = []
        if missing:
            lasts = "; ".join(f"rank {r} last entered #{_seq_of(mem, r)}" for r in missing)
            parts.append(f"{who(missing, by_rank)} never entered {what} ({lasts})")
        if unseen:
            parts.append(f"{unseen} member(s) of {label} have no progress record")
        age = max(g.age for v, g in mem.values() if v.rank in waiting)
        parts.append(f"{who(waiting, by_rank)} {_wait(waiting)} in it (for {age:.1f}s)")
        found.append(("; ".join(parts), missing))
    return found


def _seq_of(mem: Mapping[int, tuple[RankView, GroupView]], rank: int) -> int:
    return next(g.seq for v, g in mem.values() if v.rank == rank)


def _p2p_findings(views: Sequence[RankView],
                  members: Mapping[str, Mapping[int, tuple[RankView, GroupView]]],
                  by_rank: Mapping[int, RankView]) -> list[tuple[str, int]]:
    found = []
    for v in views:
        for g in v.waiting:
            if g.p2p != _RECV or g.peer not in members.get(g.label, {}):
                continue
            peer, peer_group = members[g.label][g.peer]
            both = peer_group.in_flight and peer_group.p2p == _RECV and \
                peer_group.peer == g.group_rank
            tail = " (each waits to receive from the other: a deadlock)" if both else ""
            found.append((f"{who([v.rank], by_rank)} waits in {g.op} #{g.seq} on {g.label} to "
                          f"receive from {who([peer.rank], by_rank)} (its rank {g.peer} there) "
                          f"for {g.age:.1f}s{tail}", peer.rank))
    return found


def _nobody_missing(views: Sequence[RankView], by_rank: Mapping[int, RankView]) -> str:
    waits: dict[str, list[int]] = {}
    for v in views:
        for g in v.waiting[:1]:
            waits.setdefault(f"{g.op} #{g.seq} on {g.label}", []).append(v.rank)
    if not waits:
        return "no rank is inside a communication operation"
    return "; ".join(f"{who(rs, by_rank)} {_wait(rs)} in {op}" for op, rs in waits.items()) + \
        ": every member entered it, but it does not complete (a network or device problem?)"


def _wait(ranks: Sequence[int]) -> str:
    return "waits" if len(ranks) == 1 else "wait"


def _describe(v: RankView) -> str:
    if v.state == "stopped":
        return f"is stopped (SIGSTOP/SIGTSTP); `kill -CONT {v.pid}` on its host resumes it"
    if v.state == "exited":
        return "has exited"
    if v.state == "no-record":
        return "has written no progress record (still starting, or not using dtrain's trainer)"
    step = f" at step {v.step}" if v.step else ""
    waiting = v.waiting
    if waiting:
        g = waiting[0]
        return f"waits in {g.op} #{g.seq} on {g.label}{step} (for {g.age:.1f}s)"
    last = min(v.groups, key=lambda g: g.age, default=None)
    since = f"; its last operation, {last.op} #{last.seq} on {last.label}, began " \
        f"{last.age:.1f}s ago" if last else ""
    return f"is in no communication operation{step} (computing or blocked elsewhere){since}"


def _payload(g: GroupView) -> str:
    if not g.nbytes:
        return ""
    return f" ({g.dtype or 'data'}, {_size(g.nbytes)})"


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    return f"{n / 1024:.1f} KiB" if n < 1024 * 1024 else f"{n / 1024 / 1024:.1f} MiB"
