"""A resume never crashes on, and never destroys, what a power loss, a full disk or a changed
model leaves: a torn ``metrics.jsonl`` is cleaned (said once), a checkpoint of another model is
refused without renaming anything even under ``--resume-fallback``, and every file a resume
reads (tensor files and index, the commit record) is verified before the checkpoint is chosen.
Real runs: ``dtrain launch`` of ``python -m trainer.train`` with a tiny model."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import REPO, dtrain_env, run_dtrain
from tests.support.mpi_runs import forked_python
from trainer.recsys import evaluate
from trainer.training.metrics import read_records

FLAGS = ["--model", "tiny", "--n-layer", "1", "--d-model", "32", "--seq-len", "32",
         "--global-batch", "4", "--steps", "4", "--warmup-steps", "1", "--data-cap-mb", "0.25",
         "--log-every", "1", "--eval-every", "0", "--save-every", "1", "--keep", "3"]


def launch(run_dir: Path, *extra: str, ranks: int = 2) -> tuple[int, str]:
    """``dtrain launch --nproc-per-node N -- python -m trainer.train`` (dp N unless given)."""
    done = run_dtrain(["launch", "--nproc-per-node", str(ranks), "--", *forked_python(), "-m",
                       "trainer.train", *FLAGS, "--run-dir", str(run_dir), *extra], timeout=240)
    return done.returncode, done.stdout + done.stderr


def train_serial(run_dir: Path, *extra: str) -> tuple[int, str]:
    done = subprocess.run([*forked_python(), "-m", "trainer.train", *FLAGS, "--run-dir",
                           str(run_dir), *extra], capture_output=True, text=True, cwd=REPO,
                          env=dtrain_env(), timeout=240, check=False)
    return done.returncode, done.stdout + done.stderr


def rank_lines(out: str, text: str) -> list[str]:
    """The lines of the ranks' own output (``[r@host]`` prefix) that contain ``text``."""
    return [line for line in out.splitlines() if re.match(r"\[\d+@", line) and text in line]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(run_dir / "metrics.jsonl")}


@pytest.fixture(scope="module")
def dp2_straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight")
    code, out = launch(run_dir)
    assert code == 0, out[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def dp2_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dp 2 run stopped after step 2: checkpoints step-1 and step-2."""
    run_dir = tmp_path_factory.mktemp("dp2")
    code, out = launch(run_dir, "--stop-at", "2")
    assert code == 0, out[-3000:]
    return run_dir


@pytest.fixture
def dp2_run(dp2_base: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(dp2_base, tmp_path / "run"))


def test_a_torn_metrics_file_is_cleaned_once_and_the_resume_matches_an_uninterrupted_run(
        dp2_straight: Path, dp2_run: Path) -> None:
    metrics = dp2_run / "metrics.jsonl"
    first, second = metrics.read_bytes().splitlines(keepends=True)
    # A power loss leaves NUL blocks where data was not yet written; a full disk a cut line.
    metrics.write_bytes(first + b"\0" * 300 + b"\n" + second + b'{"step": 3, "loss": 5.1')
    code, out = launch(dp2_run, "--resume")
    assert code == 0, out[-3000:]
    [warning] = rank_lines(out, "warning: torn lines dropped")
    assert f"[{metrics}, line(s) 2, 4]: 2 line(s) are not JSON records" in warning, warning
    assert "Traceback" not in out
    assert losses(dp2_run) == losses(dp2_straight)
    assert b"\0" not in metrics.read_bytes()
    assert [r["step"] for r in read_records(metrics)] == [1, 2, 3, 4]


def test_the_recommenders_torn_evaluations_are_dropped_the_same_way(tmp_path: Path) -> None:
    evals = tmp_path / "evals.jsonl"
    evals.write_bytes(b'{"step": 5, "val_loss": 0.6, "val_auc": 0.7}\n\0\0\0\n{"step": 10, "v')
    warning = evaluate.truncate(tmp_path, 10)
    assert warning.startswith(f"warning: torn lines dropped [{evals}, line(s) 2, 3]: 2 line(s)")
    assert evals.read_text() == '{"step": 5, "val_loss": 0.6, "val_auc": 0.7}\n'
    assert evaluate.truncate(tmp_path, 10) == ""  # said once: the file is clean now


def test_resume_fallback_refuses_a_checkpoint_of_another_model_once_and_renames_nothing(
        dp2_run: Path) -> None:
    ckpts = dp2_run / "checkpoints"
    code, out = launch(dp2_run, "--resume", "--resume-fallback", "--d-model", "64")
    assert code == 2, out[-3000:]
    [line] = rank_lines(out, "error:")
    assert f"error: checkpoint does not match this run [{ckpts / 'step-2'}]: differing " \
           "fields: d_model: checkpoint 32, now 64" in line, line
    assert "damaged" not in out and "skips" not in out
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-1", "step-2"]
    code, out = launch(dp2_run, "--resume")  # the checkpoints are all still there, and good
    assert code == 0 and "resumed at step 2" in out, out[-3000:]


@pytest.fixture(scope="module")
def zero_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dp 2 ZeRO-1 run stopped after step 2: every rank wrote its optimizer shard."""
    run_dir = tmp_path_factory.mktemp("zero")
    code, out = launch(run_dir, "--zero", "1", "--stop-at", "2")
    assert code == 0, out[-3000:]
    return run_dir


def flip_bit(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["rank-00001.safetensors", "index.json"])
def test_resume_fallback_skips_a_checkpoint_whose_tensor_file_or_index_is_damaged(
        zero_base: Path, tmp_path: Path, name: str) -> None:
    run_dir = Path(shutil.copytree(zero_base, tmp_path / "run"))
    damaged = run_dir / "checkpoints" / "step-2" / name
    flip_bit(damaged, damaged.stat().st_size // 2)
    code, out = launch(run_dir, "--zero", "1", "--resume", "--resume-fallback")
    assert code == 0, out[-3000:]
    [skip] = rank_lines(out, "--resume-fallback skips step-2")
    assert f"is damaged [file {name}]: checksum mismatch" in skip, skip
    assert "resumed at step 1 (--resume-fallback set aside damaged step-2 (now step-2.damaged-" \
        in out, out[-3000:]
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]


@pytest.mark.parametrize("key", ["format", "files"])
def test_a_flipped_bit_in_a_commit_record_key_is_damage_that_resume_fallback_skips(
        dp2_run: Path, key: str) -> None:
    marker = dp2_run / "checkpoints" / "step-2" / "COMMITTED"
    flip_bit(marker, marker.read_bytes().index(f'"{key}"'.encode()) + 1)  # "format" -> "gormat"
    code, out = launch(dp2_run, "--resume")
    assert code == 2, out[-3000:]
    [line] = rank_lines(out, "error:")
    assert f"error: checkpoint {marker.parent} is damaged [file COMMITTED]: the commit record " \
           "does not describe a checkpoint: its keys are " in line, line
    assert line.endswith("add --resume-fallback to resume from the newest checkpoint that "
                         "verifies")
    code, out = launch(dp2_run, "--resume", "--resume-fallback")
    assert code == 0, out[-3000:]
    assert "resumed at step 1 (--resume-fallback set aside damaged step-2" in out, out[-3000:]
