"""The leader's commit of a save in place begins once it has read every rank's record of its
write (`trainer.checkpoint.records`), not once the agreement that every write succeeded has
gone round every rank; the agreement is still read, at `finish`, and a rank that left no
record is heard of through it.

Two ranks of one group run in this process one after the other, as the ranks of one host do;
their agreement completes only when the test says so."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import inotify_simple
import pytest
import torch

from trainer.checkpoint import CheckpointError, rank_file
from trainer.checkpoint.layout import committed
from trainer.checkpoint.records import Gathering, leave
from trainer.checkpoint.save import Save, claim, opened
from trainer.comm.protocol import ReduceOp


class _Pending:
    """An agreement in flight, until the test `complete`s it with the MAX every rank
    posted."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.done, self.waited = t, False, False

    def complete(self, *values: int) -> None:
        self.t.copy_(torch.tensor(values, dtype=self.t.dtype))
        self.done = True

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> None:
        if not self.done:
            raise AssertionError("waited for an agreement nobody completes: the test hangs")
        self.waited = True


class _OneOfTwo:
    """Rank ``rank`` of a group of two: every collective stays in flight (`posted`), or,
    where ``failed`` says what every rank posted, completes with it."""

    size = 2

    def __init__(self, rank: int, failed: tuple[int, ...] = ()) -> None:
        self.rank, self.failed = rank, failed
        self.posted: list[_Pending] = []

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False) -> _Pending:
        self.posted.append(_Pending(t))
        if self.failed:
            self.posted[-1].complete(*self.failed)
        return self.posted[-1]


def _save(root: Path, token: int, rank: int, failed: tuple[int, ...] = ()) -> Save:
    job = opened(root, 1, token, None, tensors={"w": torch.full((3000 + rank,), float(rank))},
                 contents=[rank], meta={"m": 1}, keep=0,
                 group=_OneOfTwo(rank, failed),  # type: ignore[arg-type]
                 device=torch.device("cpu"))
    assert job is not None
    job.checks = (0, 7)  # a weight check and a step count, as a save in place agrees them
    return job


def test_the_leader_commits_once_every_record_is_read_and_reads_the_agreement_at_finish(
        tmp_path: Path) -> None:
    token, _ = claim(tmp_path, 1)
    other, leader = _save(tmp_path, token, 1), _save(tmp_path, token, 0)
    other.write()
    leader.write()
    leader.settle(None)
    assert leader.agreed == [0, 7]  # the checks, MAXed from the records
    leader.commit()
    assert committed(leader.final)
    assert sorted(p.name for p in leader.final.glob("rank-*")) == \
        [rank_file(0), rank_file(1)]  # no record left behind
    settled = leader.group.posted[0]  # type: ignore[attr-defined]
    assert not settled.waited
    settled.complete(0, -2, 0, 7)
    finished = leader.finish(None, failed=False)
    assert finished == leader.final and settled.waited


def test_a_rank_that_left_no_record_is_heard_of_through_the_agreement(tmp_path: Path) -> None:
    token, _ = claim(tmp_path, 1)
    # Rank 1 failed to write: it left no record, and posted its failure.
    leader = _save(tmp_path, token, 0, failed=(1, -1, 0, 7))
    leader.write()
    with pytest.raises(CheckpointError, match="another writer \\(rank 1\\) failed"):
        leader.settle(None)
    assert not leader.tmp.exists()  # the leader removed what the save left


class _Deaf:
    """inotify where a record is renamed by another host (NFS, Lustre): nothing is told."""

    waiting = threading.Event()

    def add_watch(self, path: Path, mask: int) -> int:
        return 1

    def read(self, timeout: int) -> list[object]:
        _Deaf.waiting.set()
        time.sleep(timeout / 1000)
        return []

    def close(self) -> None:
        pass


def test_a_record_inotify_never_tells_of_is_read_at_the_leaders_next_look(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inotify_simple, "INotify", _Deaf)
    gathering = Gathering(tmp_path, 2)
    gathering.own({"files": {}, "synced": True, "checks": [0]})
    gathering.start()
    assert _Deaf.waiting.wait(60)  # the leader looked, found no record, and waits
    leave(tmp_path, 1, {"files": {}, "synced": True, "checks": [3]})
    assert gathering.until(_Pending(torch.zeros(1)))  # the agreement never completes
    assert [record["checks"] for record in gathering.rest()] == [[0], [3]]


def test_the_reader_is_done_with_the_other_ranks_records_before_the_leader_gives_its_own(
        tmp_path: Path) -> None:
    """No rename announces the leader's own record: a reader that waited for it as well
    slept a whole slow look after the last record whenever the leader wrote last."""
    gathering = Gathering(tmp_path, 3)
    gathering.start()
    for rank in (1, 2):
        leave(tmp_path, rank, {"files": {}, "synced": True, "checks": [rank]})
    assert gathering._reader is not None
    gathering._reader.join(60)
    assert not gathering._reader.is_alive()  # finished without the leader's record
    gathering.own({"files": {}, "synced": True, "checks": [0]})
    assert gathering.until(_Pending(torch.zeros(1)))  # the agreement never completes
    assert [record["checks"] for record in gathering.rest()] == [[0], [1], [2]]
