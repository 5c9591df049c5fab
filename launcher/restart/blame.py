"""Which hosts a failed round blames, and which of them must leave the job now (pure).

From what the head already knows, the first cause wins:

1. a hang under `--hang-action abort`: the hosts of the ranks the diagnosis names; they leave
   (a rank that never enters a collective is most often a sick GPU, link or driver);
2. a host lost (its agent's stream broke or fell silent): it leaves (it cannot be reached);
3. an agent that reported an error (a rank that could not start there): it leaves;
4. an MPI_Abort, a rank killed by a signal, or the first rank that exited non-zero: that
   rank's host; it stays for now (most crashes are the program's own, and a restart in place
   is the cheapest), and `launcher.restart.pool` excludes a host blamed a second time.

Ranks dtrain stopped after the first failure are never blamed.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from launcher.head.outcome import Failure, JobOutcome, signal_name


@dataclass(frozen=True)
class Blame:
    cause: str
    """What happened, in a few words: "hang", "host lost", "rank killed by SIGKILL", ..."""
    hosts: tuple[str, ...]
    """The hosts blamed, in the order the failure names them."""
    leave: tuple[str, ...]
    """Those of ``hosts`` that must leave the job before the next round."""
    detail: str
    """The failure as the exit report words it: ``rank 3@node2: exited with code 1``."""


def blame(outcome: JobOutcome, *, lost: Collection[str] = (),
          hung: Collection[int] = ()) -> Blame | None:
    """The blame for a round that failed; None when nothing failed. ``lost``: hosts lost
    before dtrain began stopping the round; ``hung``: the ranks a hang diagnosis named when
    it stopped the round (`--hang-action abort`)."""
    hosts_of = {r.rank: r.host for r in outcome.ranks.values()}
    first = outcome.abort or (outcome.failures[0] if outcome.failures else None)
    if hung:
        hosts = _unique(hosts_of[r] for r in sorted(hung) if r in hosts_of)
        detail = _detail(first) if first else "hang"
        return Blame("hang", hosts, hosts, detail)
    if lost:
        named = _hosts_in(first.where, hosts_of) if first else ()
        hosts = _unique([*[h for h in named if h in lost], *sorted(lost)])
        return Blame("host lost", hosts, hosts, _detail(first) if first else "host lost")
    if first is None:
        return None
    hosts = _hosts_in(first.where, hosts_of)
    if first.where.startswith("host "):
        return Blame("agent error", hosts, hosts, _detail(first))
    if first is outcome.abort:
        return Blame("MPI_Abort", hosts, (), _detail(first))
    return Blame(_rank_cause(first, outcome), hosts, (), _detail(first))


def _rank_cause(failure: Failure, outcome: JobOutcome) -> str:
    rank = failure.rank if failure.rank is not None else _rank_in(failure.where)
    state = outcome.ranks.get(rank) if rank is not None else None
    if state is not None and state.signal:
        return f"rank killed by {signal_name(state.signal)}"
    return f"rank exited {failure.code}"


def _detail(failure: Failure) -> str:
    return f"{failure.where}: {failure.why}"


def _hosts_in(where: str, hosts_of: Mapping[int, str]) -> tuple[str, ...]:
    """The hosts of a failure's ``where`` (`launcher.head.outcome.Failure`): ``host H``, or
    ``rank R@H`` items separated by commas (a hang names several)."""
    found = []
    for item in where.split(","):
        item = item.strip()
        if item.startswith("host "):
            found.append(item[len("host "):])
        elif item.startswith("rank ") and "@" in item:
            rank = _rank_in(item)
            found.append(hosts_of.get(rank, item.partition("@")[2]) if rank is not None
                         else item.partition("@")[2])
    return _unique(found)


def _rank_in(where: str) -> int | None:
    text = where.strip().removeprefix("rank ").partition("@")[0]
    return int(text) if text.isdigit() else None


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    out: list[str] = []
    for item in items:
        if item not in out:
            out.append(item)
    return tuple(out)
