"""A hang of an MPI program that keeps no progress record, seen from outside (pure).

An MPICH rank that leaves its program (returns from its main, calls ``sys.exit``) while the
others still communicate blocks in MPI_Finalize, whose PMI barrier waits for every rank: the
job never ends, and the ranks waiting in a collective spin at a full core, so neither their
records (they keep none) nor their CPU use tell a hang. Two facts from outside do:

* the agent's PMI proxy sees a rank in a PMI barrier (`RankView.fence_age`): MPI_Init's
  wire-up or MPI_Finalize (the MPI features that fence elsewhere, spawn and name publishing,
  are refused by dtrain's PMI);
* a native stack (``py-spy dump --native``) of each other rank shows the MPI call it is in.
  One inside an MPI operation other than MPI_Init has finished MPI_Init, and so has every
  rank (its wire-up barrier needs them all): the barrier is MPI_Finalize's.

`suspects` says when to look (a rank in a barrier for the hang timeout while another runs
outside it); `views` turns the stacks into the views the causes engine reads: each rank
inside an MPI call waits in it (named by the call; MPI's communicator and sequence number are
not visible from outside: seq 0), each fenced rank is "finalizing", a member of each of those
operations that never entered it. None when no other rank is inside an MPI call: they compute
(rank 0 writing a checkpoint while the others are done), which is no hang.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from launcher.hang.views import GroupView, RankView
from records import replace

# py-spy prints C frames as ``PMPI_Allreduce_c (libmpi.so.12)``; ``_c`` is MPI 4's large-count
# variant. MPICH's internals (MPIR_, MPID_, MPIDI_) are not the API a program called.
_CALL = re.compile(r"^\s*P?(MPI_[A-Z][A-Za-z_]*?)(?:_c)? \(", re.MULTILINE)
#: Calls a rank makes on its way in or out of MPI, where it waits for PMI, not for peers.
NOT_WAITING = frozenset({"MPI_Init", "MPI_Init_thread", "MPI_Finalize"})


def mpi_call(stack: str) -> str | None:
    """The MPI function a native stack is inside (its outermost MPI frame), None if none."""
    found = _CALL.findall(stack)
    return found[-1] if found else None


def suspects(views: Iterable[RankView], timeout: float) -> tuple[list[int], list[int]]:
    """(fenced, others): the ranks in a PMI barrier for ``timeout`` or longer, and
    the live ranks outside it whose stacks would tell whether they wait; ([], []) when there
    is nothing to look at."""
    # The head asks once per event it handles: the common answer (nobody fenced that long)
    # in one pass over the views, without building the other lists.
    live_states = ("running", "no-record")
    fenced = [v.rank for v in views if v.fence_age is not None and v.fence_age >= timeout
              and v.state in live_states]
    if not fenced:
        return [], []
    others = [v.rank for v in views if v.fence_age is None and v.state in live_states]
    return (sorted(fenced), sorted(others)) if fenced and others else ([], [])


def views(seen: Mapping[int, RankView], stacks: Mapping[int, str], timeout: float,
          ) -> list[RankView] | None:
    """The views for the causes engine once the stacks are in; None when no rank outside the
    barrier is inside an MPI call (no hang)."""
    fenced, others = suspects(seen.values(), timeout)
    calls = {r: c for r in others if (c := mpi_call(stacks.get(r, ""))) and c not in NOT_WAITING}
    if not fenced or not calls:
        return None
    size = len(seen)
    ops = sorted(set(calls.values()))
    out = []
    for rank, v in sorted(seen.items()):
        if rank in calls:
            g = GroupView(calls[rank], rank, size, 0, -1, calls[rank],
                          history=((0, calls[rank], -1, 1),))
            out.append(replace(v, state="running", groups=(g,)))
        elif rank in fenced:
            out.append(replace(v, state="finalizing", groups=tuple(
                GroupView(op, rank, size, 0, 0, "") for op in ops)))
        else:
            out.append(replace(v, state="running" if v.state == "no-record" else v.state))
    return out
