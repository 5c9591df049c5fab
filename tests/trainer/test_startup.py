"""Bad input is refused before training, printed once per job, and every rank exits with 2.

First the agreement itself (`trainer.training.startup.agree`) on an in-memory world; then real jobs
through ``dtrain launch --nproc-per-node 2``, counting the lines the ranks printed (the launcher
relays them as ``[rank@host] line``; its exit report may quote the failed rank's last stderr
lines once more, which is the launcher's report, not a rank's print).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import PYTHON, run_dtrain
from trainer.data.corpus import load_corpus
from trainer.training.startup import Failure, agree, env_rank, same_data

RANK_LINE = re.compile(r"^\[\d+@[^\]]+\] (.*)$", re.MULTILINE)
TRAIN = ["--model", "tiny", "--steps", "1", "--global-batch", "4", "--data-cap-mb", "0.25",
         "--eval-every", "0"]


class FakeWorld:
    """One rank's view of a world whose ranks contribute ``values`` to the allgather."""

    def __init__(self, rank: int, values: list) -> None:
        self.rank, self.failures, self.barriers = rank, values, 0

    def allgather(self, mine: object) -> list:
        assert mine == self.failures[self.rank]
        return list(self.failures)

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return len(self.failures)

    def Barrier(self) -> None:  # noqa: N802
        self.barriers += 1


def test_every_rank_gets_the_lowest_failing_ranks_failure_and_only_that_rank_prints(
        capsys) -> None:
    failures = [None, Failure("error: bad [x]: why. Fix", 2), Failure("error: other", 3)]
    worlds = [FakeWorld(r, failures) for r in range(3)]
    outputs = []
    for world in worlds:
        assert agree(world, failures[world.rank]) == failures[1]
        outputs.append(capsys.readouterr().err)
    # Rank 0 did not fail, so the message names the rank it is about.
    assert outputs == ["", "[rank 1] error: bad [x]: why. Fix\n", ""]
    assert [w.barriers for w in worlds] == [1, 1, 1]  # nobody leaves before the print


def test_a_failure_of_every_rank_is_printed_once_without_a_rank(capsys) -> None:
    failures = [Failure("error: same", 2)] * 2
    printed = []
    for rank in range(2):
        agree(FakeWorld(rank, failures), failures[rank])
        printed.append(capsys.readouterr().err)
    assert printed == ["error: same\n", ""]


def test_no_failure_anywhere_returns_none_and_skips_the_barrier() -> None:
    world = FakeWorld(0, [None, None])
    assert agree(world, None) is None and world.barriers == 0


def test_ranks_that_read_different_data_all_fail_naming_the_ranks_of_each_version(
        tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one version")
    (tmp_path / "b.txt").write_text("another version")
    first, second = load_corpus(str(tmp_path / "a.txt")), load_corpus(str(tmp_path / "b.txt"))
    seen = [(first.fingerprint, first.source)] * 2 + [(second.fingerprint, second.source)]
    for rank, corpus in enumerate((first, first, second)):
        failure = same_data(FakeWorld(rank, seen), corpus)
        assert failure is not None and failure.code == 2
        assert f"a.txt = {first.fingerprint} on rank(s) 0, 1; " in failure.message
        assert f"b.txt = {second.fingerprint} on rank(s) 2]" in failure.message
    assert same_data(FakeWorld(0, seen[:2]), first) is None


def test_the_rank_comes_from_the_launchers_variables() -> None:
    assert env_rank({"RANK": "3", "PMI_RANK": "1"}) == 3
    assert env_rank({"PMI_RANK": "1"}) == 1
    assert env_rank({}) == 0


def launch(*flags: str, nproc: int = 2) -> tuple[int, list[str], str]:
    """(exit code, the lines the ranks printed, everything) of a 2-rank training job."""
    res = run_dtrain(["launch", "--nproc-per-node", str(nproc), "--", PYTHON, "-m",
                      "trainer.train", *TRAIN, *flags], timeout=240)
    out = res.stdout + res.stderr
    return res.returncode, RANK_LINE.findall(out), out


def once(lines: list[str], text: str) -> bool:
    return sum(text in line for line in lines) == 1


@pytest.fixture
def text_and_utf8(tmp_path: Path) -> Path:
    """A data folder whose second file has a non-ASCII byte (0xC3 of 'ï') on line 3."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("plain ascii text\n" * 400)
    (data / "b.txt").write_text("line one\nline two\nna\u00efve\n")
    return data


def bad_inputs(tmp_path: Path, utf8: Path) -> dict[str, tuple[list[str], str]]:
    empty = tmp_path / "empty"
    empty.mkdir()
    return {
        "zero data cap": (["--data-cap-mb", "0"],
                          "error: invalid option [--data-cap-mb 0.0]: must be > 0"),
        "empty data folder": (["--data", str(empty)],
                              f"error: no training data [{empty}]: the folder has no"),
        # At tp 2 the vocab-parallel embedding silently zeroed such bytes before.
        "vocab smaller than the bytes at tp 2": (
            ["--data", str(utf8), "--tp", "2", "--vocab-size", "128"],
            f"error: vocabulary too small for the data [--vocab-size 128; byte 195 at "
            f"{utf8 / 'b.txt'}:3]"),
        "fewer ranks than tp x pp": (
            ["--tp", "2", "--pp", "2"],
            "one model copy takes tp*pp = 4 ranks, more than the 2 started. Start a multiple "
            "of 4 ranks (e.g. --nproc-per-node 4)"),
    }


@pytest.mark.parametrize("case", ["zero data cap", "empty data folder",
                                  "vocab smaller than the bytes at tp 2",
                                  "fewer ranks than tp x pp"])
def test_bad_input_is_printed_once_and_every_rank_exits_2_without_abort(
        case: str, tmp_path: Path, text_and_utf8: Path) -> None:
    flags, message = bad_inputs(tmp_path, text_and_utf8)[case]
    code, lines, out = launch(*flags)
    assert code == 2, out[-3000:]
    assert once(lines, message), out[-3000:]
    assert sum("error" in line for line in lines) == 1, out[-3000:]
    assert "Traceback" not in out and "MPI_Abort" not in out and "Abort(" not in out


def test_an_unknown_flag_prints_usage_once(tmp_path: Path) -> None:
    code, lines, out = launch("--no-such-flag", "--run-dir", str(tmp_path))
    assert code == 2, out[-3000:]
    assert once(lines, "usage: python -m trainer.train"), out[-3000:]
    assert once(lines, "error: unrecognized arguments: --no-such-flag"), out[-3000:]


def test_binary_files_in_the_data_are_warned_about_once_and_training_runs(
        tmp_path: Path, text_and_utf8: Path) -> None:
    (text_and_utf8 / "c.bin").write_bytes(b"\x00\x01\x02 binary" * 10)
    code, lines, out = launch("--data", str(text_and_utf8), "--run-dir", str(tmp_path / "run"))
    assert code == 0, out[-3000:]
    assert once(lines, f"warning: binary data in the training text [{text_and_utf8 / 'c.bin'}]"
                ": 1 file(s) have NUL bytes or are not UTF-8"), out[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").exists()
