"""Bad input that used to end in a traceback: one clear error, printed once, exit 2, found where
the options are checked (before the model or the data are built). Real jobs of 2 ranks through
``dtrain launch``, and ``python -m trainer.generate`` as a user runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO, dtrain_env, run_dtrain
from tests.support.mpi_runs import forked_python
from trainer.checkpoint import checksum

TRAIN = ["--model", "tiny", "--n-layer", "1", "--d-model", "32", "--seq-len", "32",
         "--global-batch", "4", "--steps", "1", "--warmup-steps", "1", "--data-cap-mb", "0.1",
         "--eval-every", "0"]
RANK_LINE = re.compile(r"^\[(\d+)@[^\]]+\] (.*)$", re.MULTILINE)


def launch(module: str, *flags: str) -> tuple[int, list[str], str]:
    """(exit code, the lines the ranks printed, everything) of a 2-rank job of ``module``."""
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--", *forked_python(), "-m", module,
                      *flags], timeout=240)
    out = res.stdout + res.stderr
    return res.returncode, [text for _, text in RANK_LINE.findall(out)], out


def assert_one_error(code: int, lines: list[str], out: str, message: str) -> None:
    assert code == 2, out[-3000:]
    errors = [line for line in lines if "error" in line.lower()]
    assert len(errors) == 1 and message in errors[0], out[-3000:]
    assert "Traceback" not in out and "Abort(" not in out
    assert "parameters" not in out  # refused before the model was built


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder on a read-only file system (a tmpfs mounted ``ro``), unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "ro"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)],
                   check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_run_dir_that_is_a_file_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    (tmp_path / "notes").write_text("mine")
    code, lines, out = launch("trainer.train", *TRAIN, "--run-dir", str(tmp_path / "notes"))
    assert_one_error(code, lines, out, f"error: run dir is not a folder [--run-dir "
                     f"{tmp_path / 'notes'}]: {tmp_path / 'notes'} is a file. Pass a folder")
    assert (tmp_path / "notes").read_text() == "mine"


def test_a_run_dir_on_a_read_only_file_system_is_refused_before_anything_is_built(
        read_only_dir: Path) -> None:
    code, lines, out = launch("trainer.train", *TRAIN, "--run-dir", str(read_only_dir / "run"))
    assert_one_error(code, lines, out, f"error: run dir is not writable [--run-dir "
                     f"{read_only_dir / 'run'}]: {read_only_dir} is on a read-only file system")


@pytest.mark.parametrize(("flags", "message"), [
    (["--data-cap-mb", "inf"], "error: invalid option [--data-cap-mb inf]: must be a finite "
                               "number"),
    (["--lr", "inf"], "error: invalid option [--lr inf]: must be a finite number"),
    (["--lr", "nan"], "error: invalid option [--lr nan]: must be a finite number"),
    (["--seed", str(2**64)], f"error: invalid option [--seed {2**64}]: must be below 2**64"),
    (["--cp", "2", "--seq-len", "30"], "error: sequence does not split over the context-"
     "parallel ranks [--seq-len 30 --cp 2]: the sequence is cut into 2 x cp = 4 equal chunks"),
    (["--document-mask"], "error: document masking needs an end-of-document token "
     "[--document-mask --data (the default corpus)]: byte-level text has no token that ends a "
     "document"),
], ids=["data-cap-inf", "lr-inf", "lr-nan", "seed-2**64", "cp-seq-len", "document-mask-text"])
def test_a_value_no_run_can_use_is_refused_where_the_options_are_checked(
        tmp_path: Path, flags: list[str], message: str) -> None:
    code, lines, out = launch("trainer.train", *TRAIN, *flags, "--run-dir", str(tmp_path / "r"))
    assert_one_error(code, lines, out, message)
    assert not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def newer_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run whose checkpoint's meta.json names a model field this dtrain lacks, its commit
    record updated to match (what a newer dtrain would write)."""
    run_dir = tmp_path_factory.mktemp("newer")
    done = subprocess.run([*forked_python(), "-m", "trainer.train", *TRAIN, "--run-dir",
                           str(run_dir)], capture_output=True, text=True, cwd=REPO,
                          env=dtrain_env(), timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    step = run_dir / "checkpoints" / "step-1"
    meta = json.loads((step / "meta.json").read_text())
    meta["model"]["attention_sinks"] = 4
    (step / "meta.json").write_text(json.dumps(meta))
    record = json.loads((step / "COMMITTED").read_text())
    data = (step / "meta.json").read_bytes()
    record["files"]["meta.json"] = {"size": len(data), checksum.WRITTEN: checksum.of_file(
        step / "meta.json", checksum.WRITTEN)}
    (step / "COMMITTED").write_text(json.dumps(record))
    return run_dir


def test_generate_refuses_a_checkpoint_whose_model_has_a_field_it_does_not_know(
        newer_checkpoint: Path) -> None:
    done = subprocess.run([*forked_python(), "-m", "trainer.generate", "--run-dir",
                           str(newer_checkpoint), "--prompt", "def "], capture_output=True,
                          text=True, cwd=REPO, env=dtrain_env(), timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    meta = newer_checkpoint / "checkpoints" / "step-1" / "meta.json"
    assert done.stderr.strip() == (
        f"error: checkpoint of a newer dtrain [{meta}]: its model has field(s) this dtrain does "
        "not know: attention_sinks. Sample with the dtrain that trained it (or a newer one)")


def test_resume_refuses_a_checkpoint_whose_model_has_a_field_it_does_not_know(
        newer_checkpoint: Path) -> None:
    code, lines, out = launch("trainer.train", *TRAIN, "--steps", "2", "--resume",
                              "--run-dir", str(newer_checkpoint))
    assert code == 2, out[-3000:]
    [error] = [line for line in lines if "error" in line]
    assert "checkpoint does not match this run" in error
    assert "attention_sinks: checkpoint 4, unknown to this dtrain" in error, error


def criteo_lines(n: int) -> str:
    return "".join(f"{i % 2}\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["a1"] * 26) + "\n"
                   for i in range(n))


@pytest.mark.parametrize("source", ["synthetic", "criteo-file"])
def test_the_recommender_refuses_fewer_training_rows_than_one_step_takes(
        tmp_path: Path, source: str) -> None:
    flags = ["--global-batch", "256", "--steps", "2", "--eval-every", "0", "--run-dir",
             str(tmp_path / "run")]
    if source == "synthetic":
        flags += ["--rows", "100"]
        where = "[--rows 100 --global-batch 256]: 90 training row(s)"
    else:
        (tmp_path / "day.tsv").write_text(criteo_lines(50))
        flags += ["--data", str(tmp_path / "day.tsv"), "--vocab", "16"]
        where = f"[--data {tmp_path / 'day.tsv'} --global-batch 256]: 45 training row(s)"
    code, lines, out = launch("trainer.recsys", *flags)
    assert code == 2, out[-3000:]
    [error] = [line for line in lines if "error" in line.lower()]
    assert f"error: too few training rows for one step {where} after the --val-fraction 0.1 " \
           "split, and every step takes 256. Give more rows, or a smaller --global-batch" \
        in error, error
    assert "Traceback" not in out and "Abort(" not in out
