"""Blame for a hang (`launcher.hang.causes`, `launcher.hang.diagnose`): the rank that skipped an
operation is the one blamed, never a rank that only waits for it.

The hangs are made by running a small SPMD program under an in-memory fake of MPI's matching
rules (`tests.support.hangsim`) on dp 2 x tp 2 (2 hosts x 2 ranks) with one rank leaving out one
operation; the same programs on real MPICH ranks under `dtrain launch` are in
`tests/cluster/test_hang_cluster.py`.
"""

from __future__ import annotations

import pytest

from launcher.hang.diagnose import diagnose
from launcher.hang.views import GroupView, RankView
from tests.support.hangsim import Op, groups_of, run
from trainer.comm.mesh import splits
from trainer.comm.topology import MeshShape

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")
STEPS = 3


def step_ops() -> list[Op]:
    """One training step: every kind on the TP group, a DP all-reduce, every kind on the world."""
    return [*(Op("tp", k) for k in KINDS), Op("dp", "all_reduce"),
            *(Op("world", k) for k in KINDS)]


#: The splits of `Mesh.build` on the world, before the first step (hang_worker's dp 2 x tp 2).
SPLITS = len(splits(MeshShape(dp=2, tp=2)))


def program() -> list[Op]:
    start = [Op("world", "split")] * SPLITS
    return [*start, *(step_ops() * STEPS), Op("world", "barrier")]


def skipped(kind: str, family: str, step: int = STEPS) -> tuple[int, str]:
    """(index in `program`, seq on its group) of ``kind`` on ``family`` in ``step``."""
    ops = program()
    index = SPLITS + (step - 1) * len(step_ops()) + step_ops().index(Op(family, kind))
    seq = sum(1 for op in ops[:index + 1] if op.group == family)
    return index, seq


def _case_id(kind: str, family: str, rank: int) -> str:
    label, members = groups_of(rank)[family]
    role = ("-root" if members.index(rank) == 0 else "-nonroot") if kind == "broadcast" else ""
    return f"{kind}{role}-{family}-rank{rank}"


def _is_root(kind: str, family: str, rank: int) -> bool:
    return kind == "broadcast" and groups_of(rank)[family][1].index(rank) == 0


# A skipped receive of a small broadcast hangs nobody under MPI (the root's eager send returns);
# with large messages (rendezvous) or NCCL the root waits for it.
CASES = [(k, f, r, eager) for k in KINDS for f in ("tp", "world") for r in range(4)
         for eager in (True, False) if not (eager and k == "broadcast" and not _is_root(k, f, r))]


@pytest.mark.parametrize(("kind", "family", "rank", "eager"), CASES,
                         ids=[f"{_case_id(*c[:3])}-{'eager' if c[3] else 'rendezvous'}"
                              for c in CASES])
def test_the_rank_that_skipped_an_operation_is_the_one_blamed_by_the_headline(kind, family, rank,
                                                                               eager):
    index, seq = skipped(kind, family)
    views = run(program(), skip=(rank, index), eager=eager)
    found = diagnose(views)
    label = groups_of(rank)[family][0]
    op = "batch_p2p" if kind == "p2p" else kind
    host = "node1" if rank < 2 else "node2"
    assert found.culprit_ranks == (rank,), found.text
    assert found.blamed_hosts == (host,)
    assert (found.group, found.op, found.seq) == (label, op, seq), found.text
    assert found.headline.startswith(f"rank {rank} ({host}) "), found.text
    assert f"{op} #{seq} on {label}" in found.headline
    waiting = {v.rank for v in views if v.waiting} - {rank}
    assert waiting and not waiting & set(found.culprit_ranks)
    assert all(f"rank {r} " not in line.split(":")[0] or "consequence" in line
               for line in found.lines for r in waiting if line.startswith("also:"))


@pytest.mark.parametrize(("kind", "eager"), [(k, e) for k in KINDS for e in (True, False)
                                             if not (e and k == "broadcast")])
def test_a_skip_in_an_earlier_step_still_blames_the_rank_that_skipped(kind, eager):
    """Later operations of the same kind match one step off (MPI matches a kind in call
    order), so the others end up waiting in the last one: still the skipping rank is blamed."""
    index, _ = skipped(kind, "tp", step=2)
    found = diagnose(run(program(), skip=(1, index), eager=eager))
    assert found.culprit_ranks == (1,), found.text


def _tp_group(rank: int, *ops: tuple[str, int, bool], coll: int | None = None) -> GroupView:
    """tp[0] of ``rank`` whose history is ``ops`` (name, peer, completed), numbered from 15."""
    history, count = [], 0
    for n, (name, peer, _) in enumerate(ops, start=15):
        count += name != "batch_p2p"
        history.append((n, name, peer, 9 + count))
    last = history[-1]
    done = last[0] - (0 if ops[-1][2] else 1)
    return GroupView("tp[0]", rank, 2, last[0], done, last[1], "float32",
                     2 if last[1] == "batch_p2p" else 0, last[2], 1024, age=10.0,
                     history=tuple(history))


def test_the_issue_case_rank_past_an_all_reduce_it_skipped_is_blamed_not_the_waiters():
    """Rank 0 skipped all_reduce #16 on tp[0]; its next tp[0] operation was a broadcast it
    roots (which returned at once), and it blocked in batch_p2p #17 receiving from rank 1,
    which waits in all_reduce #16. The other TP group ran all_reduce #16 and a broadcast #17;
    DP waits for the stuck pair."""
    views = [
        RankView(0, "node1", 100, groups=(_tp_group(0, ("all_reduce", -1, True),
                                                    ("broadcast", 0, True),
                                                    ("batch_p2p", 1, False)),)),
        RankView(1, "node1", 101, groups=(_tp_group(1, ("all_reduce", -1, True),
                                                    ("all_reduce", -1, False)),)),
        *(RankView(r, "node2", 100 + r, groups=(
            GroupView("tp[1]", r - 2, 2, 17, 17, "broadcast", peer=0, history=(
                (15, "all_reduce", -1, 10), (16, "all_reduce", -1, 11),
                (17, "broadcast", 0, 12))),
            GroupView(f"dp[{r - 2}]", 1, 2, 4, 3, "all_reduce", age=9.0, history=(
                (4, "all_reduce", -1, 4),)))) for r in (2, 3)),
    ]
    views[0] = RankView(0, "node1", 100, groups=(*views[0].groups, GroupView(
        "dp[0]", 0, 2, 3, 3, "all_reduce", history=((3, "all_reduce", -1, 3),))))
    views[1] = RankView(1, "node1", 101, groups=(*views[1].groups, GroupView(
        "dp[1]", 0, 2, 3, 3, "all_reduce", history=((3, "all_reduce", -1, 3),))))
    found = diagnose(views)
    assert found.culprit_ranks == (0,) and found.kind == "past", found.text
    assert (found.group, found.op, found.seq) == ("tp[0]", "all_reduce", 16)
    assert found.headline.startswith(
        "rank 0 (node1) is past all_reduce #16 on tp[0] (float32, 1.0 KiB), which rank 1 "
        "(node1) waits in: it entered broadcast #16 (root 0) there, which returned"), found.text
    assert "now it waits in batch_p2p #17 on tp[0]" in found.headline
    assert ("  rank 1 (node1) waits in all_reduce #16 on tp[0] (for 10.0s) for rank 0 (node1): "
            "a consequence, not a cause") in found.lines
    assert sum("(node2) waits in all_reduce #4 on dp[" in line and "a consequence" in line
               for line in found.lines) == 2


def test_two_members_at_the_same_number_in_different_operations_are_named_a_mismatch():
    views = run(program(), skip=(1, skipped("all_reduce", "tp")[0]))
    found = diagnose(views)
    _, seq = skipped("all_reduce", "tp")
    assert found.kind == "mismatch", found.text
    assert found.headline.startswith(
        f"rank 1 (node1) entered all_gather #{seq} on tp[0] where the other members entered "
        f"all_reduce #{seq} on tp[0] (float32, 1.0 KiB), which rank 0 (node1) waits in (a "
        "mismatch"), found.text


def test_a_mismatch_nothing_can_decide_blames_both_members():
    """A world of two: each member waits at #5 in another operation, and no other group runs
    the same program to tell which one is right."""
    def member(r: int, op: str) -> RankView:
        return RankView(r, f"n{r}", 10 + r, groups=(GroupView(
            "world", r, 2, 5, 4, op, history=((4, "all_reduce", -1, 4), (5, op, -1, 5))),))

    found = diagnose([member(0, "all_reduce"), member(1, "all_gather")])
    assert found.kind == "mismatch" and set(found.culprit_ranks) == {0, 1}, found.text
    assert set(found.blamed_hosts) == {"n0", "n1"}
