"""The polite wait for a communication handle (`trainer.comm.protocol.wait_quietly`): polls
with sleeps, growing up to ``longest`` when asked, then completes the handle."""

from __future__ import annotations

import time

import pytest

from trainer.comm.protocol import wait_quietly


class CountedHandle:
    """Completes after ``polls`` calls of ``is_completed``; records ``wait``."""

    def __init__(self, polls: int) -> None:
        self.left, self.waited = polls, False

    def is_completed(self) -> bool:
        self.left -= 1
        return self.left < 0

    def wait(self) -> None:
        self.waited = True


def _sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    return slept


def test_a_wait_polls_at_the_interval_given_and_completes_the_handle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slept = _sleeps(monkeypatch)
    handle = CountedHandle(5)
    wait_quietly(handle, 2e-4)
    assert slept == [2e-4] * 5
    assert handle.waited


def test_a_wait_with_a_longest_sleep_doubles_each_sleep_up_to_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slept = _sleeps(monkeypatch)
    handle = CountedHandle(7)
    wait_quietly(handle, 2e-4, longest=1e-3)
    assert slept == pytest.approx([2e-4, 4e-4, 8e-4, 1e-3, 1e-3, 1e-3, 1e-3])
    assert handle.waited


def test_a_longest_sleep_below_the_interval_keeps_the_interval(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slept = _sleeps(monkeypatch)
    wait_quietly(CountedHandle(3), 5e-4, longest=1e-4)
    assert slept == [5e-4] * 3
