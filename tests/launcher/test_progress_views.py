"""The agent's reading of its ranks' progress records (`launcher.agent.progress`): what each
rank's view says from the files its folder holds, and that a reading lists the folder once and
opens only the files it lists (a rank that wrote nothing costs no system call).

The host is an in-memory fake (`launcher.agent.host.Host`'s reading of /proc and its records'
folder, here a temporary one); the records are written in `workerenv`'s layout."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

import workerenv
from launcher.agent import flight
from launcher.agent import progress as progress_mod
from launcher.agent.host import Host
from launcher.agent.progress import ProgressReporter


class FakeHost(Host):
    """Records in ``folder``; every live rank reads as running, 1 CPU second."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def records_folder(self, job_id: str) -> str:
        return str(self.folder)

    def stat(self, pid: int | None) -> tuple[str, float | None, bool]:
        return "running", 1.0, False


def _record(path: str, pid: int, rank: int, step: int) -> None:
    now = time.monotonic()
    head = workerenv.PROGRESS_HEADER.pack(workerenv.PROGRESS_MAGIC, pid, rank, step, now,
                                          0.5, 0.5, 1, now)
    Path(path).write_bytes(head.ljust(workerenv.PROGRESS_SIZE, b"\0"))


def _reporter(tmp_path: Path, ranks: list[int]) -> tuple[ProgressReporter, list[Any]]:
    sent: list[Any] = []
    reporter = ProgressReporter("job", "h1", ranks, 1.0, sent.append,
                                lambda: frozenset({2}), FakeHost(tmp_path))
    return reporter, sent


def test_each_ranks_view_comes_from_the_files_its_folder_holds(tmp_path: Path) -> None:
    reporter, _ = _reporter(tmp_path, [0, 1, 2, 3])
    _record(reporter.path(0), pid=100, rank=0, step=7)  # trainer.comm's own record
    shim = flight.path(reporter.path(1))  # a torch.distributed program's, through the shim
    Path(shim).write_text(json.dumps({"pid": 101, "rank": 1, "groups": [], "spins": True}))
    Path(shim + ".left").touch()  # and it left its main
    views = {v.rank: v for v in reporter.views({0: 100, 1: 101, 2: 102, 3: 103})}
    assert (views[0].pid, views[0].step, views[0].state, views[0].recorder) == (
        100, 7, "running", "")
    assert (views[1].pid, views[1].recorder, views[1].returned, views[1].state) == (
        101, "flight-spin", True, "exited")
    # No record: the agent's own pid, and what the agent knows (in a PMI barrier).
    assert (views[2].state, views[2].pid, views[2].fence_age) == ("no-record", 102, 0.0)
    assert views[3].fence_age is None and not views[3].returned
    assert views[0].cpu_share == 0.0  # a share needs two readings half a second apart


def test_a_reading_lists_the_folder_once_and_opens_only_the_files_it_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reporter, sent = _reporter(tmp_path, list(range(8)))
    _record(reporter.path(5), pid=105, rank=5, step=1)
    calls: list[str] = []
    real_listdir, real_open = os.listdir, os.open

    def listdir(path: Any) -> list[str]:
        calls.append(f"listdir {path}")
        return real_listdir(path)

    def counted_open(path: Any, *args: Any, **kw: Any) -> int:
        calls.append(f"open {path}")
        return real_open(path, *args, **kw)

    monkeypatch.setattr(progress_mod.os, "listdir", listdir)
    monkeypatch.setattr(progress_mod.os.path, "exists", lambda p: pytest.fail(f"stat {p}"))
    monkeypatch.setattr(flight.os, "open", counted_open)
    reporter.tick(10.0, {r: 100 + r for r in range(8)})
    assert calls == [f"listdir {tmp_path}"]  # rank 5's record is read by `open`, not os.open
    (body,) = sent
    assert [v["state"] for v in body["ranks"]] == ["no-record"] * 5 + ["running"] + [
        "no-record"] * 2


def test_a_folder_that_is_gone_reads_as_no_records_not_an_error(tmp_path: Path) -> None:
    reporter, sent = _reporter(tmp_path / "gone", [0, 1])
    reporter.final()
    assert [(v["state"], v["code"]) for v in sent[0]["ranks"]] == [("exited", None)] * 2
    assert sent[0]["final"] is True
