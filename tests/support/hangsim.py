"""An in-memory fake of MPI's matching rules that runs a small SPMD program until it hangs, and
returns the progress views the agents would send then (test support for `launcher.hang`).

The rules are MPICH's: a collective kind matches per group in call order (each kind has its own
tag, so an all_gather never completes an all_reduce); with small messages (``eager``) a
broadcast's root and every send return at once, a broadcast completes for the others once its
root entered it, a receive once its sender sent; with large ones (rendezvous, and NCCL always) a
broadcast needs every member, and a send its receiver. Every other collective completes once
every member entered it. Each rank runs its operations one after the other, blocking in each, as
the trainer does. The real
MPICH runs of the same programs are in `tests/cluster/test_hang_cluster.py`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from launcher.hang.views import GroupView, RankView

P2P_OPS = ("batch_p2p", "send", "recv")


@dataclass(frozen=True)
class Op:
    group: str      # family: "tp", "dp" or "world"
    kind: str       # all_reduce, all_gather, reduce_scatter, broadcast, barrier, split, p2p
    root: int = 0   # a broadcast's root, as a group rank


def groups_of(rank: int, size: int = 4, tp: int = 2) -> dict[str, tuple[str, list[int]]]:
    """dp x tp as `trainer.comm.topology` lays it out: family -> (label, members)."""
    t, d = rank // tp, rank % tp
    return {"world": ("world", list(range(size))),
            "tp": (f"tp[{t}]", [t * tp + i for i in range(tp)]),
            "dp": (f"dp[{d}]", [d + tp * i for i in range(size // tp)])}


class _Rank:
    def __init__(self, rank: int, program: list[Op]) -> None:
        self.rank, self.program, self.pc, self.entered = rank, program, 0, False
        self.instance = 0   # which instance of its kind the current operation is
        self.groups = groups_of(rank)
        self.slots: dict[str, dict] = {
            label: {"seq": 0, "done": 0, "op": "", "peer": -1, "coll": 0, "history": []}
            for label, _ in self.groups.values()}


def run(program: list[Op], skip: tuple[int, int] | None = None, *, eager: bool = True,
        size: int = 4, hosts: tuple[str, ...] = ("node1", "node1", "node2", "node2"),
        ) -> list[RankView]:
    """Every rank runs ``program`` but rank ``skip[0]`` leaves out its operation ``skip[1]``;
    the views once nothing moves any more (each rank blocked in an operation, or finished)."""
    ranks = [_Rank(r, [op for i, op in enumerate(program) if (r, i) != skip])
             for r in range(size)]
    posted: Counter[tuple] = Counter()   # (label, kind, member) -> instances entered
    moved = True
    while moved:
        moved = False
        for rk in ranks:
            while rk.pc < len(rk.program):
                op = rk.program[rk.pc]
                label, members = rk.groups[op.group]
                me = members.index(rk.rank)
                if not rk.entered:
                    _enter(rk, op, label, me, len(members), posted)
                    rk.entered = moved = True
                if not _complete(rk, op, label, members, me, posted, eager):
                    break
                rk.slots[label]["done"] += 1
                rk.pc, rk.entered, moved = rk.pc + 1, False, True
    return [_view(rk, hosts[rk.rank]) for rk in ranks]


def _enter(rk: _Rank, op: Op, label: str, me: int, n: int, posted: Counter[tuple]) -> None:
    slot = rk.slots[label]
    name = "batch_p2p" if op.kind == "p2p" else op.kind
    peer = (me - 1) % n if op.kind == "p2p" else op.root if op.kind == "broadcast" else -1
    slot["seq"] += 1
    slot["coll"] += name not in P2P_OPS
    slot.update(op=name, peer=peer)
    slot["history"].append((slot["seq"], name, peer, slot["coll"]))
    posted[label, op.kind, me] += 1
    rk.instance = posted[label, op.kind, me]


def _complete(rk: _Rank, op: Op, label: str, members: list[int], me: int,
              posted: Counter[tuple], eager: bool) -> bool:
    k, n = rk.instance, len(members)
    if op.kind == "p2p":  # a ring: it sends to the member after it, receives from the one before
        sent = eager or posted[label, "p2p", (me + 1) % n] >= k
        return sent and posted[label, "p2p", (me - 1) % n] >= k
    if op.kind == "broadcast" and eager:
        return me == op.root or posted[label, "broadcast", op.root] >= k
    return all(posted[label, op.kind, m] >= k for m in range(len(members)))


def _view(rk: _Rank, host: str) -> RankView:
    groups = []
    for label, members in rk.groups.values():
        s = rk.slots[label]
        if not s["seq"]:
            continue
        p2p = 2 if s["op"] == "batch_p2p" else 0
        groups.append(GroupView(label, members.index(rk.rank), len(members), s["seq"],
                                s["done"], s["op"], "float32", p2p, s["peer"], 1024,
                                age=10.0, history=tuple(s["history"][-16:])))
    state = "running" if rk.pc < len(rk.program) else "exited"
    return RankView(rk.rank, host, pid=1000 + rk.rank, state=state, step=3,
                    groups=tuple(groups))
