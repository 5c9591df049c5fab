"""``--resume`` verifies what it loads: a damaged checkpoint stops the run with one message naming
the file, ``--resume-fallback`` (only when given) skips it saying which and why, and a run dir
without checkpoints starts at step 0. Real runs: tp 2 through ``dtrain launch``, and one
process of ``python -m trainer.train``."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import REPO, dtrain_env, run_dtrain
from tests.support.mpi_runs import forked_python
from trainer.config.options import parse_args
from trainer.errors import ConfigError
from trainer.training.metrics import read_records

FLAGS = ["--model", "tiny", "--n-layer", "1", "--d-model", "32", "--seq-len", "32",
         "--global-batch", "4", "--steps", "4", "--warmup-steps", "1", "--data-cap-mb", "0.25",
         "--log-every", "1", "--save-every", "1", "--keep", "3"]


def launch_tp2(run_dir: Path, *extra: str) -> tuple[int, str]:
    done = run_dtrain(["launch", "--nproc-per-node", "2", "--", *forked_python(), "-m",
                       "trainer.train", *FLAGS, "--tp", "2", "--run-dir", str(run_dir), *extra],
                      timeout=240)
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
def tp2_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tp 2 run stopped after step 3: checkpoints step-1, step-2, step-3."""
    run_dir = tmp_path_factory.mktemp("tp2")
    code, out = launch_tp2(run_dir, "--stop-at", "3")
    assert code == 0, out[-3000:]
    return run_dir


@pytest.fixture
def tp2_run(tp2_base: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tp2_base, tmp_path / "run"))


def test_a_flipped_bit_in_a_tensor_file_stops_the_resume_with_one_message_naming_the_file(
        tp2_run: Path) -> None:
    shard = tp2_run / "checkpoints" / "step-3" / "rank-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    code, out = launch_tp2(tp2_run, "--resume")
    assert code == 2, out[-3000:]
    [line] = rank_lines(out, "error:")  # both ranks read it (replicated weights are spread)
    assert f"error: checkpoint {tp2_run / 'checkpoints' / 'step-3'} is damaged [file " \
           "rank-00001.safetensors]: checksum mismatch (xxh3_128: written " in line, line
    assert line.endswith("add --resume-fallback to resume from the newest checkpoint that "
                         "verifies")
    # Without --resume-fallback nothing is skipped, renamed or trained.
    assert sorted(p.name for p in (tp2_run / "checkpoints").iterdir()) == [
        "step-1", "step-2", "step-3"]
    assert "step      4" not in out


def test_an_empty_rng_file_read_by_every_rank_is_reported_once(tp2_run: Path) -> None:
    (tp2_run / "checkpoints" / "step-3" / "rng.safetensors").write_bytes(b"")
    code, out = launch_tp2(tp2_run, "--resume")
    assert code == 2, out[-3000:]
    [line] = rank_lines(out, "error:")  # both ranks read the RNG file; the lowest one reports
    assert "[rank 0] error: checkpoint " in line and \
        "step-3 is damaged [file rng.safetensors]: it has 0 bytes, the commit record " in line, \
        line


def test_resume_fallback_skips_a_damaged_checkpoint_saying_which_and_why_and_trains_on(
        tp2_base: Path, tp2_run: Path) -> None:
    optim = tp2_run / "checkpoints" / "step-3" / "rank-00000.safetensors"
    optim.write_bytes(optim.read_bytes()[:100])
    code, out = launch_tp2(tp2_run, "--resume", "--resume-fallback")
    assert code == 0, out[-3000:]
    [skip] = rank_lines(out, "--resume-fallback skips")
    assert "step-3 is damaged [file rank-00000.safetensors]: it has 100 bytes" in skip, skip
    assert re.search(r"resumed at step 2 \(--resume-fallback set aside damaged step-3 \(now "
                     r"step-3\.damaged-[0-9a-f]{8}\)\)", out), out[-3000:]
    names = sorted(p.name for p in (tp2_run / "checkpoints").iterdir())
    assert [re.sub(r"damaged-[0-9a-f]{8}$", "damaged-*", n) for n in names] == [
        "step-2", "step-3", "step-3.damaged-*", "step-4"]  # step 3 saved anew, step 1 pruned
    aside = tp2_run / "checkpoints" / names[2]  # kept as it was, for inspection
    assert (aside / "rank-00000.safetensors").stat().st_size == 100
    # Step 3 was trained again from the verified step 2: the same loss as the first time.
    assert losses(tp2_run)[3] == losses(tp2_base)[3] and 4 in losses(tp2_run)


@pytest.fixture(scope="module")
def serial_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("serial")
    code, out = train_serial(run_dir, "--stop-at", "2")
    assert code == 0, out[-3000:]
    return run_dir


def test_resume_fallback_stops_when_no_checkpoint_verifies(serial_base: Path,
                                                           tmp_path: Path) -> None:
    run_dir = Path(shutil.copytree(serial_base, tmp_path / "run"))
    for step in (1, 2):
        (run_dir / "checkpoints" / f"step-{step}" / "rank-00000.safetensors").write_bytes(b"")
    code, out = train_serial(run_dir, "--resume", "--resume-fallback")
    assert code == 2, out[-3000:]
    assert re.findall(r"--resume-fallback skips (step-\d+): checkpoint .* is damaged \[file "
                      r"rank-00000.safetensors\]: it has 0 bytes", out) == ["step-2", "step-1"]
    assert re.search(r"error: no checkpoint verifies \[.*checkpoints\]: --resume-fallback set "
                     r"aside step-2 \(now step-2\.damaged-\w+\), step-1 \(now step-1\.damaged-"
                     r"\w+\): each is damaged", out), out[-3000:]


def test_resume_without_any_checkpoint_starts_at_step_0_and_says_so(tmp_path: Path) -> None:
    code, out = train_serial(tmp_path, "--resume", "--steps", "2")
    assert code == 0, out[-3000:]
    assert f"--resume found no checkpoint in {tmp_path / 'checkpoints'}: starting at step 0" \
        in out
    assert sorted(losses(tmp_path)) == [1, 2]


def test_resume_fallback_without_resume_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"--resume-fallback without --resume "
                       r"\[--resume-fallback\]: .*\. Add --resume"):
        parse_args(["--resume-fallback"])
