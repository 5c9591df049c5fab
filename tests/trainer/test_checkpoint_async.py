"""The background checkpoint writer (``--async-save``): training goes on while a save is in
flight and the save holds the state of its own step; one save at a time; a failure in the
background stops every rank with one error; the ranks move a save on together, only once every
rank's part is written; a resume unpickles nothing. Real runs of ``python -m trainer.train``
(`tests.support.checkpoint_probe`, ``dtrain launch``), and the writer's core with in-memory
ranks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from pathlib import Path
from typing import Any

import torch

from tests.support import REPO, dtrain_env, run_dtrain
from tests.support.mpi_runs import forked_python
from tests.support.saved import saved_state
from tests.trainer.test_checkpoint_safety import small_disk  # noqa: F401 - a fixture
from trainer.checkpoint.layout import CheckpointError
from trainer.checkpoint.writer import WRITER_NICE, Writer
from trainer.training.metrics import read_records

FLAGS = ["--model", "tiny", "--n-layer", "1", "--d-model", "32", "--seq-len", "32",
         "--global-batch", "4", "--warmup-steps", "1", "--data-cap-mb", "0.25",
         "--log-every", "1", "--eval-every", "0"]


def probe(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    done = subprocess.run([*forked_python(), "-m", "tests.support.checkpoint_probe", *args],
                          capture_output=True, text=True, cwd=REPO, env=dtrain_env(env),
                          timeout=240, check=False)
    return done.returncode, done.stdout + done.stderr


def test_steps_after_a_save_run_before_it_commits_and_it_holds_the_weights_of_its_step(
        tmp_path: Path) -> None:
    out = tmp_path / "seen.json"
    code, text = probe("hold", "3", str(out), "--", *FLAGS, "--steps", "6", "--save-every",
                       "3", "--keep", "0", "--run-dir", str(tmp_path / "run"))
    assert code == 0, text[-3000:]
    seen = json.loads(out.read_text())
    events = seen["events"]
    assert "hold timed out" not in events, events
    # Steps 4 and 5 ran while checkpoint 3 was still being written, let alone committed.
    assert events.index("step 5") < events.index("write 3") < events.index("commit 3"), events
    # One save in flight: the last one (step 6) starts writing once checkpoint 3 is committed.
    assert events.index("commit 3") < events.index("write 6"), events
    saved = saved_state(tmp_path / "run" / "checkpoints" / "step-3")["param"]
    for name, flat in seen["weights"]["3"].items():
        assert torch.equal(saved[name].reshape(-1), torch.tensor(flat)), name
    assert any(seen["weights"]["5"][name] != flat
               for name, flat in seen["weights"]["3"].items())  # training moved them on
    reports = [r for rec in read_records(tmp_path / "run" / "metrics.jsonl")
               for r in rec["checkpoint"] or []]
    assert [r["step"] for r in reports] == [3, 6]
    assert all(r["mb"] > 0 and len(r["rank_mb_s"]) == 1 for r in reports)


def test_a_resume_unpickles_nothing_even_when_torch_is_told_to_unpickle_anything(
        tmp_path: Path) -> None:
    run = ["--run-dir", str(tmp_path / "run")]
    code, text = probe("no-pickle", "--", *FLAGS, "--steps", "2", "--save-every", "1", *run)
    assert code == 0, text[-3000:]
    code, text = probe("no-pickle", "--", *FLAGS, "--steps", "3", "--resume", *run,
                       env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})
    assert code == 0, text[-3000:]
    assert "resumed at step 2" in text
    assert "unpickling is not allowed" not in text


def test_a_background_save_that_fails_stops_every_rank_at_a_later_step_with_one_error(
        small_disk: Path) -> None:  # noqa: F811 - the fixture
    run_dir = small_disk / "run"
    # Leave 64 KiB: the metrics fit, the two ranks' tensor files (126 KB each) do not. The
    # first save is at step 2, after step 1's record took the metrics file's first page: a
    # background save does not hold the ranks together at its step, so rank 1 could fill the
    # disk with a save at step 1 before the leader wrote its first record.
    (small_disk / "filler").write_bytes(b"x" * (256 - 64) * 1024)
    done = run_dtrain(["launch", "--nproc-per-node", "2", "--", *forked_python(), "-m",
                       "trainer.train", *FLAGS, "--tp", "2", "--steps", "8", "--save-every", "2",
                       "--run-dir", str(run_dir)], timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    said = [line for line in out.splitlines() if re.match(r"\[\d+@", line) and "error" in line]
    assert len(said) == 1, said  # by one rank (the launcher's summary quotes it once more)
    assert said[0].startswith(f"[0@localhost] [rank 0] error: checkpoint save failed "
                              f"[{run_dir / 'checkpoints' / 'step-2'}]: no space left on "
                              "device"), said[0]
    assert "Traceback" not in out
    assert list((run_dir / "checkpoints").iterdir()) == []  # the partial save is removed
    steps = [r["step"] for r in read_records(run_dir / "metrics.jsonl")]
    assert 2 < steps[-1] < 8, steps  # trained on while step 2 was written, stopped after


class Votes:
    """A late MAX over in-memory ranks: each rank reads the n-th vote once all posted it."""

    def __init__(self, ranks: int) -> None:
        self.posted: list[list[int]] = [[] for _ in range(ranks)]
        self.read = [0] * ranks

    def of(self, rank: int) -> Any:
        votes = self

        class Vote:
            def post(self, value: int) -> None:
                votes.posted[rank].append(value)

            def result(self) -> int:
                n = votes.read[rank]
                votes.read[rank] += 1
                return max(p[n] for p in votes.posted)

        return Vote()


class FakeSave:
    """A save whose write waits for ``release``; records when each collective phase ran."""

    def __init__(self, release: threading.Event, fails: bool = False) -> None:
        self.step, self.release, self.fails = 7, release, fails
        self.leader = True  # commits in the writer's thread
        self.settled: CheckpointError | None | str = "not yet"
        self.finished = False
        self.told: list[bool | None] = []  # what the vote told settle and finish
        self.prune_later, self.prunable = False, False

    def attempt(self, phase: Any) -> CheckpointError | None:
        try:
            phase()
        except CheckpointError as exc:
            return exc
        return None

    def write(self) -> None:
        self.release.wait(30)
        if self.fails:
            raise CheckpointError("checkpoint save failed", "here", "a full disk", "Free it")

    def settle(self, error: CheckpointError | None, failed: bool | None = None) -> None:
        self.settled = error
        self.told.append(failed)

    def commit(self) -> None:
        pass

    def prune(self) -> None:
        pass

    def finish(self, error: CheckpointError | None, failed: bool | None = None) -> None:
        self.finished = True
        self.told.append(failed)


def drive(writers: list[Writer], saves: list[FakeSave], steps: int, *,
          joined: bool = False) -> list[tuple[Any, ...]]:
    """``steps`` step ends on every rank; after each, what every rank's save has been through
    (its settle's outcome, finished or not) and what its poll returned or raised. ``joined``:
    each step lasts until every rank's local phase is over (these steps take no time; real
    ones take long enough for the writer's thread to get the interpreter)."""
    states = []
    for _ in range(steps):
        if joined:
            for writer in writers:
                writer.join()
        polled = []
        for writer in writers:
            try:
                polled.append(writer.poll())
            except CheckpointError as exc:
                polled.append(type(exc).__name__)
        states.append(tuple((s.settled if isinstance(s.settled, str) else repr(s.settled),
                             s.finished, p is s) for s, p in zip(saves, polled, strict=True)))
    return states


def same_on_every_rank(state: tuple[Any, ...]) -> bool:
    return len({(settled == "not yet", finished, returned)
                for settled, finished, returned in state}) == 1


def test_the_ranks_move_a_save_on_together_and_only_once_every_rank_has_written() -> None:
    votes, fast, slow = Votes(2), threading.Event(), threading.Event()
    fast.set()
    saves = [FakeSave(fast), FakeSave(slow)]
    writers = [Writer(votes.of(rank), background=True) for rank in range(2)]
    for writer, save in zip(writers, saves, strict=True):
        writer.submit(save)  # type: ignore[arg-type]
    drive(writers, saves, 4)
    assert [s.settled for s in saves] == ["not yet", "not yet"]  # rank 1 is still writing
    slow.set()
    states = drive(writers, saves, 6, joined=True)
    assert all(same_on_every_rank(state) for state in states), states
    assert [s.settled for s in saves] == [None, None] and all(s.finished for s in saves)
    assert sum(state[0][2] for state in states) == 1  # each rank returned its save once
    # Every rank voted that its write, then the commit, succeeded: no phase asks again.
    assert [s.told for s in saves] == [[False, False], [False, False]]


def test_a_write_that_failed_on_one_rank_is_settled_on_every_rank_at_the_same_step() -> None:
    votes, done = Votes(2), threading.Event()
    done.set()
    saves = [FakeSave(done), FakeSave(done, fails=True)]
    writers = [Writer(votes.of(rank), background=True) for rank in range(2)]
    for writer, save in zip(writers, saves, strict=True):
        writer.submit(save)  # type: ignore[arg-type]
    states = drive(writers, saves, 4, joined=True)
    assert all(same_on_every_rank(state) for state in states), states
    assert saves[0].settled is None  # the collective settle fails every rank (save.agree)
    assert isinstance(saves[1].settled, CheckpointError) and "a full disk" in str(saves[1].settled)
    # The vote said a rank failed: every rank's settle agrees on the error collectively.
    assert [s.told[0] for s in saves] == [True, True]


class NiceRecordingSave(FakeSave):
    """A save whose write notes the nice value of the thread that writes it."""

    def __init__(self) -> None:
        done = threading.Event()
        done.set()
        super().__init__(done)
        self.nice: int | None = None

    def write(self) -> None:
        self.nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_background_writer_yields_the_cpu_to_training_and_an_in_place_save_does_not() -> None:
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    background, in_place = NiceRecordingSave(), NiceRecordingSave()
    writer = Writer(None, background=True)
    writer.submit(background)  # type: ignore[arg-type]
    writer.join()
    Writer(None, background=False).submit(in_place)  # type: ignore[arg-type]
    assert background.nice == min(own + WRITER_NICE, 19)
    assert in_place.nice == own  # written on the training thread, which keeps its priority
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own


class PruningSave(FakeSave):
    """A save whose commit leaves a pruning to do, which waits for ``deleting`` and then
    fails when told to (a folder it may not delete)."""

    def __init__(self, deleting: threading.Event, events: list[str], *, fails: bool) -> None:
        done = threading.Event()
        done.set()
        super().__init__(done)
        self.deleting, self.events, self.prune_fails = deleting, events, fails
        self.prune_later = True

    def write(self) -> None:
        self.events.append(f"write {id(self)}")

    def commit(self) -> None:
        self.prunable = True
        self.events.append("commit")

    def prune(self) -> None:
        self.deleting.wait(30)
        self.events.append("pruned")
        if self.prune_fails:
            raise CheckpointError("checkpoint save failed", "here", "cannot delete", "Fix it")


def test_a_background_save_finishes_before_its_pruning_which_runs_before_the_next_write(
) -> None:
    events: list[str] = []
    deleting = threading.Event()
    first = PruningSave(deleting, events, fails=False)
    writer = Writer(None, background=True)
    writer.submit(first)  # type: ignore[arg-type]
    finished = writer.wait()  # write, then commit; the pruning is still waiting
    assert finished is first and first.finished and events[-1] == "commit", events
    second = PruningSave(threading.Event(), events, fails=False)
    second.prune_later = False
    writer.submit(second)  # type: ignore[arg-type]  # queued behind the pruning
    assert f"write {id(second)}" not in events
    deleting.set()
    writer.wait()
    assert events[-3:] == ["pruned", f"write {id(second)}", "commit"], events
    writer.close()


def test_a_pruning_that_failed_in_the_background_fails_the_next_save_on_every_rank() -> None:
    events: list[str] = []
    deleting = threading.Event()
    deleting.set()
    writer = Writer(None, background=True)
    writer.submit(PruningSave(deleting, events, fails=True))  # type: ignore[arg-type]
    writer.wait()
    after = FakeSave(deleting)
    writer.submit(after)  # type: ignore[arg-type]
    writer.join()
    assert writer.poll() is None  # its write phase carries the pruning's error, settled as one
    assert isinstance(after.settled, CheckpointError) and "cannot delete" in str(after.settled)
    writer.close()


def test_an_in_place_writer_prunes_in_the_commit_even_when_asked_to_prune_later() -> None:
    saved = PruningSave(threading.Event(), [], fails=False)
    Writer(None, background=False).submit(saved)  # type: ignore[arg-type]
    assert saved.prune_later is False  # no thread to prune in: the save's commit prunes
