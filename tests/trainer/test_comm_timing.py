"""Exposed and total communication time (`trainer.comm.timing`), on a scripted clock.

The communicator under the timing layer is an in-memory fake whose operations advance a fake
clock by a set duration, so every interval is known exactly. The end-to-end check that TP and
PP communication is counted in a real run is in `tests/test_trainer_layouts.py`.
"""

from __future__ import annotations

import threading

import pytest
import torch

from trainer.comm.protocol import P2POp
from trainer.comm.timing import CommClock, TimedCommunicator, outside, union


class FakeTime:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeHandle:
    """Completes when the clock reaches ``done_at``; ``wait`` jumps there."""

    def __init__(self, time: FakeTime, done_at: float) -> None:
        self.time, self.done_at = time, done_at

    def is_completed(self) -> bool:
        return self.time.t >= self.done_at

    def wait(self) -> None:
        self.time.t = max(self.time.t, self.done_at)


class FakeComm:
    """Blocking calls take ``cost`` seconds; async ones finish ``cost`` after they start."""

    rank, size, name, backend = 0, 2, "fake", "fake"

    def __init__(self, time: FakeTime, cost: float) -> None:
        self.time, self.cost = time, cost

    def all_reduce(self, t, op=None, *, async_op=False):
        if async_op:
            return FakeHandle(self.time, self.time.t + self.cost)
        self.time.t += self.cost
        return None

    def batch_p2p(self, ops):
        return [FakeHandle(self.time, self.time.t + self.cost * (i + 1))
                for i, _ in enumerate(ops)]


@pytest.fixture
def setup() -> tuple[FakeTime, CommClock]:
    time = FakeTime()
    return time, CommClock(now=time)


def test_union_merges_overlaps_and_outside_measures_the_uncovered_part() -> None:
    assert union([(3, 4), (0, 2), (1, 2.5)]) == [(0, 2.5), (3, 4)]
    assert outside((1, 5), [(0, 2), (3, 4)]) == pytest.approx(2.0)


def test_a_blocking_call_is_exposed_and_total_alike(setup) -> None:
    time, clock = setup
    comm = TimedCommunicator(FakeComm(time, 0.25), clock)
    comm.all_reduce(torch.zeros(1))
    time.t += 1.0  # compute
    comm.all_reduce(torch.zeros(1))
    assert clock.take() == pytest.approx((0.5, 0.5))
    assert clock.take() == (0.0, 0.0)  # take starts over


def test_an_async_op_that_overlapped_compute_is_hidden_and_counts_only_in_total(setup) -> None:
    time, clock = setup
    comm = TimedCommunicator(FakeComm(time, 1.0), clock, handles_block=False)
    handle = comm.all_reduce(torch.zeros(1), async_op=True)
    time.t += 0.75  # backward runs while the reduction is in flight
    with clock.blocked():  # finish_grad_sync: waits the last 0.25 s
        handle.wait()
    exposed, total = clock.take()
    assert exposed == pytest.approx(0.25) and total == pytest.approx(1.0)


def test_total_is_never_below_exposed_even_when_the_wait_outlasts_every_op(setup) -> None:
    time, clock = setup
    with clock.blocked():  # e.g. waiting for a comm thread that has not started its op yet
        time.t += 0.5
    exposed, total = clock.take()
    assert exposed == pytest.approx(0.5) and total >= exposed


def test_waiting_on_pipeline_handles_blocks_from_the_first_poll_and_counts_overlaps_once(
        setup) -> None:
    time, clock = setup
    comm = TimedCommunicator(FakeComm(time, 0.5), clock)
    handles = comm.batch_p2p([P2POp("send", torch.zeros(1), 1), P2POp("recv", torch.zeros(1), 1)])
    time.t += 0.25  # the stage computes
    while not all(h.is_completed() for h in handles):  # the polite wait: polls with sleeps
        time.t += 0.125
    exposed, total = clock.take()
    # Blocked from 0.25 until the batch's last handle (1.0): one union, not a sum per handle.
    assert exposed == pytest.approx(0.75)
    # The batch is one operation from 0 to 1.0; its first 0.25 s overlapped compute.
    assert total == pytest.approx(1.0)


def test_waits_of_another_thread_are_not_the_steps(setup) -> None:
    time, clock = setup
    comm = TimedCommunicator(FakeComm(time, 0.5), clock, handles_block=False)
    worker = threading.Thread(target=lambda: comm.all_reduce(torch.zeros(1)))
    worker.start()
    worker.join()
    exposed, total = clock.take()
    assert exposed == 0.0 and total == pytest.approx(0.5)


def test_a_sub_group_is_timed_on_the_same_clock(setup) -> None:
    time, clock = setup

    class Splittable(FakeComm):
        def split(self, color, key, *, name=""):
            return FakeComm(self.time, self.cost)

    sub = TimedCommunicator(Splittable(time, 0.5), clock).split(0, 0, name="embd")
    sub.all_reduce(torch.zeros(1))
    assert clock.take() == pytest.approx((0.5, 0.5))
