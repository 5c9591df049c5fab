"""Progress records (`trainer.comm.progress`, layout in `workerenv`): written by the rank's
communicators, read back as the agent reads them (a fresh copy of the file's bytes).

The communicator under the recording layer is an in-memory fake; the records of real MPI ranks
under `dtrain launch` are read in `tests/cluster/test_hang_cluster.py`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

import workerenv
from trainer.comm.progress import ProgressRecord, RecordingCommunicator, record_of, recorded
from trainer.comm.protocol import P2POp


class FakeHandle:
    def __init__(self) -> None:
        self.done = False

    def wait(self) -> None:
        self.done = True

    def is_completed(self) -> bool:
        return self.done


class FakeComm:
    """A member of a group of ``size``; async calls return handles the test completes."""

    backend = "fake"

    def __init__(self, rank: int = 0, size: int = 2, name: str = "world") -> None:
        self.rank, self.size, self.name = rank, size, name
        self.calls: list[str] = []

    def all_reduce(self, t, op=None, *, async_op=False):
        self.calls.append("all_reduce")
        return FakeHandle() if async_op else None

    def all_gather(self, out, inp, *, async_op=False):
        self.calls.append("all_gather")

    def reduce_scatter(self, out, inp, op=None, *, async_op=False):
        self.calls.append("reduce_scatter")

    def broadcast(self, t, src, *, async_op=False):
        self.calls.append("broadcast")

    def send(self, t, dst):
        self.calls.append("send")

    def recv(self, t, src):
        self.calls.append("recv")

    def batch_p2p(self, ops):
        self.calls.append("batch_p2p")
        return [FakeHandle() for _ in ops]

    def all_to_all(self, out, inp, *, in_splits=None, out_splits=None, async_op=False):
        self.calls.append(f"all_to_all {in_splits} {out_splits}")
        return FakeHandle() if async_op else None

    def barrier(self):
        self.calls.append("barrier")

    def split(self, color, key, *, name=""):
        return FakeComm(key, 2, name)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "rank-0.progress"


def read(path: Path) -> workerenv.RankProgress:
    got = workerenv.read_progress(path.read_bytes)
    assert got is not None
    return got


def test_every_operation_advances_its_groups_sequence_number_and_names_itself(path):
    comm = RecordingCommunicator(FakeComm(), ProgressRecord(str(path), rank=3), "world")
    t = torch.ones(8, dtype=torch.bfloat16)
    comm.all_reduce(t)
    comm.all_gather(torch.ones(16), torch.ones(8))
    comm.broadcast(t, 1)
    comm.barrier()
    comm.all_to_all(torch.ones(4), torch.ones(4), in_splits=[1, 3], out_splits=[2, 2])
    rec = read(path)
    assert (rec.rank, rec.pid) == (3, os.getpid())
    (g,) = rec.groups
    assert (g.label, g.group_rank, g.group_size) == ("world", 0, 2)
    assert (g.seq, g.done, g.op) == (5, 5, "all_to_all")
    assert (g.dtype, g.nbytes) == ("float32", 16)
    assert comm.inner.calls == ["all_reduce", "all_gather", "broadcast", "barrier",
                                "all_to_all [1, 3] [2, 2]"]


def test_an_async_all_reduce_is_in_flight_until_its_handle_completes(path):
    comm = RecordingCommunicator(FakeComm(), ProgressRecord(str(path), rank=0), "world")
    handle = comm.all_reduce(torch.ones(4, dtype=torch.float64), async_op=True)
    g = read(path).groups[0]
    assert (g.seq, g.done, g.op, g.dtype, g.nbytes) == (1, 0, "all_reduce", "float64", 32)
    assert not handle.is_completed()
    handle.inner.done = True
    assert handle.is_completed()
    handle.wait()  # idempotent: counted once
    assert read(path).groups[0].done == 1


def test_an_async_variable_size_all_to_all_is_recorded_until_it_completes(path):
    comm = RecordingCommunicator(FakeComm(), ProgressRecord(str(path), rank=0), "ep[0]")
    handle = comm.all_to_all(torch.ones(3), torch.ones(5), in_splits=[5, 0],
                             out_splits=[1, 2], async_op=True)
    g = read(path).groups[0]
    assert (g.op, g.seq, g.done, g.nbytes) == ("all_to_all", 1, 0, 20)
    handle.wait()
    assert read(path).groups[0].done == 1


def test_a_batch_p2p_is_named_by_its_receive_and_done_when_all_its_handles_are(path):
    comm = RecordingCommunicator(FakeComm(), ProgressRecord(str(path), rank=0), "pp[0]")
    handles = comm.batch_p2p([P2POp("send", torch.ones(2), 1), P2POp("recv", torch.ones(3), 1)])
    g = read(path).groups[0]
    assert (g.op, g.p2p, g.peer, g.nbytes, g.done) == ("batch_p2p", 2, 1, 12, 0)
    handles[0].wait()
    assert read(path).groups[0].done == 0
    handles[1].wait()
    assert read(path).groups[0].done == 1


def test_sub_communicators_get_slots_labelled_by_name_and_color_with_repeats_numbered(path):
    world = RecordingCommunicator(FakeComm(), ProgressRecord(str(path), rank=0), "world")
    dp = world.split(1, 0, name="dp")
    world.split(1, 1, name="dp")
    dp.recv(torch.ones(1), 1)
    rec = read(path)
    assert [g.label for g in rec.groups] == ["world", "dp[1]", "dp[1]#2"]
    assert rec.groups[0].seq == 2 and rec.groups[0].op == "split"
    assert (rec.groups[1].op, rec.groups[1].p2p, rec.groups[1].peer) == ("recv", 2, 1)


def test_a_step_report_keeps_a_moving_average_of_the_compute_time(path):
    record = ProgressRecord(str(path), rank=0)
    record.step(1, 1.0)
    for step in range(2, 12):
        record.step(step, 2.0)
    rec = read(path)
    assert (rec.step, rec.compute_s) == (11, 2.0)
    assert 1.85 < rec.compute_avg_s < 2.0  # 2 - 0.8**10: one slow step fades, steadiness stays


def test_the_world_is_recorded_only_when_the_launcher_names_a_file(path):
    plain = FakeComm()
    assert recorded(plain, {}) is plain and record_of(plain) is None
    comm = recorded(plain, {workerenv.PROGRESS_FILE: str(path)})
    assert record_of(comm) is not None and path.stat().st_size == workerenv.PROGRESS_SIZE


def test_a_record_without_a_header_reads_as_none_and_extra_groups_are_not_recorded(path):
    path.write_bytes(b"\0" * workerenv.PROGRESS_SIZE)
    assert workerenv.read_progress(path.read_bytes) is None
    world = RecordingCommunicator(FakeComm(), ProgressRecord(str(path), rank=0), "world")
    subs = [world.split(i, 0, name="g") for i in range(workerenv.PROGRESS_SLOTS + 2)]
    subs[-1].barrier()  # beyond the last slot: still runs, not recorded
    assert len(read(path).groups) == workerenv.PROGRESS_SLOTS
    assert subs[-1].inner.calls == ["barrier"]


def test_a_handle_already_done_counts_the_operation_at_once(path):
    comm = RecordingCommunicator(FakeComm(), ProgressRecord(str(path), rank=0), "world")
    comm.inner.batch_p2p = lambda ops: []
    assert comm.batch_p2p([]) == []
    assert read(path).groups[0].done == 1


def test_entry_and_step_times_are_on_the_hosts_monotonic_clock_so_a_clock_step_ages_nothing(
        path):
    """The agent ages operations as ``time.monotonic() - entered_at`` on the same host: wall
    time would make every operation look hours old (or new) after an NTP step."""
    comm = RecordingCommunicator(FakeComm(), ProgressRecord(str(path), rank=0), "world")
    before = time.monotonic()
    comm.all_reduce(torch.ones(2))
    comm.record.step(1, 0.5)
    after = time.monotonic()
    rec = read(path)
    assert before <= rec.groups[0].entered_at <= after
    assert before <= rec.step_at <= after


def test_the_completed_count_is_one_aligned_word_of_the_file(path):
    """Written with a single 8-byte store, so a reader (or a SIGSTOP) never splits it."""
    world = RecordingCommunicator(FakeComm(), ProgressRecord(str(path), rank=0), "world")
    subs = [world.split(i, 0, name="g") for i in range(3)]
    for n, sub in enumerate(subs, start=1):
        for _ in range(n * 1000):
            sub.barrier()
    raw = path.read_bytes()
    for i, want in enumerate((3, 1000, 2000, 3000)):
        at = (workerenv.PROGRESS_HEADER.size + i * workerenv.PROGRESS_SLOT_SIZE
              + workerenv.PROGRESS_DONE_AT)
        assert at % 8 == 0
        assert int.from_bytes(raw[at:at + 8], sys.byteorder) == want
