"""A hung job's diagnosis: the root cause as data for the restart logic, and as text (pure).

Input: every rank's view (`launcher.hang.views`) and the Python stacks the agents could take.
`launcher.hang.causes` finds the causes; this module orders the text: one headline naming the
first cause (rank, host, operation, group, sequence number), then the other causes, then the
ranks that only wait as a consequence (never blamed), then each blamed rank's state and stack.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from launcher.hang.causes import analyse
from launcher.hang.model import P2P, Cause
from launcher.hang.views import GroupView, RankView
from launcher.hang.watch import blind

MAX_CONSEQUENCE_LINES = 12   # one per operation waited in; a big job's others are counted
MAX_NAMED = 8                # ranks named one by one with their hosts; more are given as ranges


@dataclass(frozen=True)
class Diagnosis:
    """Why a job is hung. `launcher.hang` documents the fields the restart logic reads."""

    kind: str                        # the headline cause's kind (`causes.KINDS`), or "stalled"
    culprit_ranks: tuple[int, ...]   # every rank blamed, the headline's first
    blamed_hosts: tuple[str, ...]    # their hosts, each once, in the same order
    group: str                       # the headline's group, operation and sequence number
    op: str                          # ("" and 0 when no operation names the cause)
    seq: int
    headline: str
    lines: tuple[str, ...]           # what follows the headline
    causes: tuple[Cause, ...] = ()

    @property
    def text(self) -> str:
        return "\n".join((self.headline, *self.lines))


def who(ranks: Iterable[int], views: Mapping[int, RankView]) -> str:
    """``rank 2 (node2)`` or ``ranks 0, 1 (node1), 3 (node2)``: ranks grouped by host; beyond
    `MAX_NAMED` ranks, ``2047 ranks 0-76, 78-2047 (256 hosts)``."""
    ordered = sorted(set(ranks))
    if len(ordered) > MAX_NAMED:
        hosts = len({views[r].host for r in ordered if r in views})
        return f"{len(ordered)} ranks {_ranges(ordered)} ({hosts} host{'s' * (hosts != 1)})"
    by_host: dict[str, list[int]] = {}
    for r in ordered:
        by_host.setdefault(views[r].host if r in views else "?", []).append(r)
    parts = [f"{', '.join(map(str, rs))} ({host})" for host, rs in by_host.items()]
    return f"{'rank' if len(ordered) == 1 else 'ranks'} {', '.join(parts)}"


def _ranges(ordered: Sequence[int], most: int = 6) -> str:
    runs: list[list[int]] = []
    for r in ordered:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    shown = [f"{a}-{b}" if b > a else str(a) for a, b in runs[:most]]
    return ", ".join(shown) + (", ..." if len(runs) > most else "")


def diagnose(views: Sequence[RankView], stacks: Mapping[int, str] | None = None) -> Diagnosis:
    by_rank = {v.rank: v for v in views}
    found = analyse(views)
    told = [_cause_text(c, by_rank, found.needs) for c in found.causes]
    lines = [f"also: {t}" for t in told[1:]]
    lines += _consequences(found.explained, found.needs, by_rank)
    stalled = [v for v in views if v.waiting and v.rank not in found.explained
               and v.rank not in {c.rank for c in found.causes}]
    headline = told[0] if told else _blind(views, stacks or {}) if blind(views) else \
        _stalled(stalled or list(views), by_rank)
    if told and stalled:
        lines.append(_stalled(stalled, by_rank))
    culprits = tuple(c.rank for c in found.causes)
    for r in culprits:
        lines.append(f"  {who([r], by_rank)}: {describe(by_rank[r])}" if r in by_rank else
                     f"  rank {r}: has no progress record")
    for r in (culprits or tuple(sorted(by_rank))):
        if stacks and stacks.get(r):
            lines.append(f"  stack of rank {r} (pid {by_rank[r].pid}):")
            lines += [f"    {s}" for s in stacks[r].rstrip().splitlines()]
    hosts = tuple(dict.fromkeys(by_rank[r].host for r in culprits if r in by_rank))
    first = found.causes[0] if found.causes else None
    return Diagnosis(first.kind if first else "stalled", culprits, hosts,
                     first.label if first else "", first.op if first else "",
                     first.seq if first else 0, headline, tuple(lines), found.causes)


def _cause_text(c: Cause, by_rank: Mapping[int, RankView],
                needs: Mapping[int, Sequence[int]]) -> str:
    me = who([c.rank], by_rank)
    waiters = who(c.waiters, by_rank) if c.waiters else ""
    waited = next((g for w in c.waiters if w in by_rank
                   for g in by_rank[w].waiting if g.label == c.label), None)
    what = f"{at(c.op, c.seq, c.label)}{_payload(waited)}" if c.op else ""
    which = f", which {waiters} {_wait(c.waiters)} in" if waiters and what else ""
    now = _now(by_rank.get(c.rank))
    if c.kind == "past":
        did = f"it entered {c.instead} there, which returned" if c.instead else \
            "it went on beyond what its history holds"
        return (f"{me} is past {what}{which}: {did} (it skipped {c.op} #{c.seq}, or ran another "
                f"operation in its place); {now}")
    if c.kind == "mismatch":
        return (f"{me} entered {c.instead} on {c.label} where the other members entered {what}"
                f"{which} (a mismatch: the same point of the program, different operations); "
                f"{now}")
    if c.kind == "unsent":
        return _unsent(c, by_rank)
    if c.kind == "behind" and c.op in P2P and what:
        return f"{me} never posted its part of {what}{which}; {now}"
    if c.kind == "behind" and what:
        since = f": it entered {c.instead}" if c.instead else ""
        return f"{me} never entered {what}{which}{since}; {now}"
    if c.kind == "deadlock":
        circle = [r for r in needs.get(c.rank, ()) if r in c.waiters]
        return (f"{me} waits in {c.op} #{c.seq} on {c.label} for {who(circle, by_rank)}, which "
                f"{_wait(circle)} for it in turn (a deadlock)")
    state = describe(by_rank[c.rank]) if c.rank in by_rank else "has no progress record"
    return f"{me} {state}" + (f"; {waiters} {_wait(c.waiters)} for it in {what}"
                              if waiters and what else "")


def _unsent(c: Cause, by_rank: Mapping[int, RankView]) -> str:
    """The sender first, then the ranks receiving from it, then any others that wait for it."""
    mine = by_rank[c.rank].group(c.label) if c.rank in by_rank else None
    recvs = {w: g for w in c.waiters if w in by_rank and (g := by_rank[w].group(c.label))
             and g.in_flight and g.op in P2P and mine and g.peer == mine.group_rank}
    first = next(iter(recvs.values()), None)
    into = f"{first.op} #{first.seq} on {c.label}" if first else "the matching receive"
    others = [w for w in c.waiters if w not in recvs]
    also = f"; {who(others, by_rank)} {_wait(others)} for it too" if others else ""
    return (f"{who([c.rank], by_rank)} is stalled inside {c.op} #{c.seq} on {c.label}"
            f"{_payload(mine)} to {who(recvs, by_rank) if recvs else 'its receiver'}, which "
            f"{_wait(list(recvs))} in {into} for it: the posted send never arrives (its host's "
            f"network, or the transport under it, does not deliver){also}")


def _now(v: RankView | None) -> str:
    if v is None:
        return "it has no progress record"
    g = v.waiting[0] if v.waiting else None
    if v.state != "running" or g is None:
        return f"it {describe(v)}"
    return f"now it waits in {at(g.op, g.seq, g.label)}"


def _consequences(explained: Iterable[int], needs: Mapping[int, Sequence[int]],
                  by_rank: Mapping[int, RankView]) -> list[str]:
    lines: dict[tuple[str, int, str, tuple[int, ...]], list[int]] = {}
    for r in sorted(explained):
        g = by_rank[r].waiting[0]
        lines.setdefault((g.label, g.seq, g.op, tuple(needs[r])), []).append(r)
    out = []
    for (label, seq, op, needed), ranks in list(lines.items())[:MAX_CONSEQUENCE_LINES]:
        age = max(g.age for r in ranks for g in by_rank[r].waiting[:1])
        since = f" (for {age:.1f}s)" if seq else ""  # an MPI call seen from outside: unknown
        out.append(f"  {who(ranks, by_rank)} {_wait(ranks)} in {at(op, seq, label)}{since} "
                   f"for {who(needed, by_rank)}: a consequence, not a cause")
    if len(lines) > MAX_CONSEQUENCE_LINES:
        rest = sum(len(rs) for rs in list(lines.values())[MAX_CONSEQUENCE_LINES:])
        out.append(f"  and {rest} more ranks waiting as a consequence")
    return out


def _blind(views: Sequence[RankView], stacks: Mapping[int, str]) -> str:
    """The headline of a program without records (`watch.blind`): where each rank's main
    thread is, by its stack (py-spy's innermost frame), since no operation can be named."""
    by_rank = {v.rank: v for v in views}
    where: dict[str, list[int]] = {}
    for v in sorted(views, key=lambda v: v.rank):
        frame = innermost(stacks.get(v.rank, ""))
        state = "{is} stopped (SIGSTOP/SIGTSTP)" if v.state == "stopped" else \
            f"{{is}} in {frame}" if frame else "{has} no stack (py-spy missing or not allowed)"
        where.setdefault(state, []).append(v.rank)
    return ("no rank keeps a record of its communication (it uses neither torch.distributed, "
            "MPI nor dtrain's trainer), so no operation can be blamed; every rank sleeps or "
            "blocks: " + "; ".join(
                f"{who(rs, by_rank)} " + state.format(**{"is": "is" if len(rs) == 1 else "are",
                                                         "has": "has" if len(rs) == 1 else "have"})
                for state, rs in where.items()))


def innermost(stack: str) -> str:
    """``wait_for (worker.py:12)``: the innermost frame of the main thread (the first
    thread) of a ``py-spy dump``; "" when there is none."""
    lines = stack.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Thread ") and
                  "MainThread" in line), next((i for i, line in enumerate(lines)
                                               if line.startswith("Thread ")), None))
    if start is None or start + 1 >= len(lines):
        return ""
    frame = lines[start + 1].strip()
    return frame if frame and not frame.startswith("Thread ") else ""


def _stalled(views: Sequence[RankView], by_rank: Mapping[int, RankView]) -> str:
    waits: dict[str, list[int]] = {}
    for v in views:
        for g in v.waiting[:1]:
            waits.setdefault(at(g.op, g.seq, g.label), []).append(v.rank)
    if not waits:
        return "no rank is inside a communication operation"
    return "; ".join(f"{who(rs, by_rank)} {_wait(rs)} in {op}" for op, rs in waits.items()) + \
        ": every member entered it, but it does not complete (a network or device problem?)"


def at(op: str, seq: int, label: str) -> str:
    """``all_reduce #5 on dp[0]``; an MPI call seen from outside has neither (`hang.mpi`)."""
    return f"{op} #{seq} on {label}" if seq else op


def _wait(ranks: Sequence[int]) -> str:
    return "waits" if len(ranks) == 1 else "wait"


def describe(v: RankView) -> str:
    """What a rank does now, for the lines under the headline."""
    if v.state == "stopped":
        return f"is stopped (SIGSTOP/SIGTSTP); `kill -CONT {v.pid}` on its host resumes it"
    if v.state == "exited":
        return _exited(v)
    if v.state == "finalizing":
        return (f"is in MPI_Finalize for {v.fence_age or 0.0:.1f}s: it has left its program "
                "(returned from its main or called exit) while others still communicate")
    if v.state == "no-record":
        return "has written no progress record (still starting, or not using dtrain's trainer)"
    step = f" at step {v.step}" if v.step else ""
    if v.waiting:
        g = v.waiting[0]
        return f"waits in {at(g.op, g.seq, g.label)}{step} (for {g.age:.1f}s)"
    last = min(v.groups, key=lambda g: g.age, default=None)
    since = f"; its last operation, {last.op} #{last.seq} on {last.label}, began " \
        f"{last.age:.1f}s ago" if last else ""
    return f"is in no communication operation{step} (computing or blocked elsewhere){since}"


def _exited(v: RankView) -> str:
    how = "" if v.code is None else f" with code {v.code}" if v.code < 128 else \
        f" with code {v.code} (killed by signal {v.code - 128})"
    if v.returned and v.code is None:
        return ("has returned from its main while the others still communicate (its process "
                "has not ended: torch.distributed's teardown waits)")
    if v.returned:
        return f"has returned from its main and exited{how} while the others still communicate"
    return f"has exited{how}"


def _payload(g: GroupView | None) -> str:
    if g is None or not g.nbytes:
        return ""
    return f" ({g.dtype or 'data'}, {_size(g.nbytes)})"


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    return f"{n / 1024:.1f} KiB" if n < 1024 * 1024 else f"{n / 1024 / 1024:.1f} MiB"
