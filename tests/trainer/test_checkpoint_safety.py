"""What a run never does to files it did not write: a checkpoint linked into the run dir (or
planted there) is reported and left alone, never emptied by pruning; a new run never mixes with
another run's checkpoints (refused, or moved aside with --overwrite); a full disk during a save
is one error, and the partial save is removed; a planted pickle never runs. Real runs of ``python -m
trainer.train`` with a tiny model, multi-rank through ``dtrain launch``."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support import REPO, dtrain_env, run_dtrain
from tests.support.mpi_runs import forked_python
from trainer.checkpoint import checksum
from trainer.config.options import parse_args
from trainer.errors import ConfigError
from trainer.training.metrics import read_records

FLAGS = ["--model", "tiny", "--n-layer", "1", "--d-model", "32", "--seq-len", "32",
         "--global-batch", "4", "--warmup-steps", "1", "--data-cap-mb", "0.25",
         "--log-every", "1", "--eval-every", "0"]


def train(run_dir: Path, *extra: str, env: dict[str, str] | None = None
          ) -> tuple[int, str]:
    done = subprocess.run([*forked_python(), "-m", "trainer.train", *FLAGS, "--run-dir",
                           str(run_dir), *extra], capture_output=True, text=True, cwd=REPO,
                          env=dtrain_env(env), timeout=240, check=False)
    return done.returncode, done.stdout + done.stderr


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (links listed by their target, not followed)."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder, name)
            out[str(path.relative_to(root))] = (f"-> {os.readlink(path)}" if path.is_symlink()
                                               else hashlib.sha256(path.read_bytes()).hexdigest())
    return out


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An earlier run's checkpoints step-1 and step-2, kept elsewhere."""
    run_dir = tmp_path_factory.mktemp("archive")
    code, out = train(run_dir, "--steps", "2", "--save-every", "1", "--keep", "0")
    assert code == 0, out[-3000:]
    return run_dir / "checkpoints"


def test_pruning_never_deletes_through_a_linked_or_planted_step_and_reports_each_once(
        archive: Path, tmp_path: Path) -> None:
    before = snapshot(archive)
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / "step-1").symlink_to(archive / "step-1")  # an archived checkpoint linked back
    (ckpts / "step-2.tmp-0000abcd").symlink_to(archive / "step-2")  # looks like a dead save
    (ckpts / "step-9").write_text("not a folder")
    code, out = train(tmp_path / "run", "--steps", "3", "--save-every", "2", "--keep", "1")
    assert code == 0, out[-3000:]
    assert snapshot(archive) == before  # nothing of the link targets was deleted
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "step-1", "step-2.tmp-0000abcd", "step-3", "step-9"]
    assert (ckpts / "step-1").is_symlink() and (ckpts / "step-9").read_text() == "not a folder"
    for name, what in (("step-1", f"a symbolic link to {archive / 'step-1'}"),
                       ("step-2.tmp-0000abcd", "a symbolic link"), ("step-9", "not a folder")):
        lines = [line for line in out.splitlines() if f"[{ckpts / name}]" in line]
        assert len(lines) == 1, out[-3000:]
        assert lines[0].startswith(f"warning: not a checkpoint folder [{ckpts / name}]: it is "
                                   f"{what}"), lines[0]
    assert "error" not in out


def test_a_link_in_the_place_of_the_step_being_saved_is_refused_not_followed(
        archive: Path, tmp_path: Path) -> None:
    before = snapshot(archive)
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / "step-2").symlink_to(archive / "step-1")
    code, out = train(tmp_path / "run", "--steps", "2")
    assert code == 2, out[-3000:]
    assert snapshot(archive) == before
    assert f"error: refusing to delete a checkpoint [{ckpts / 'step-2'}]: it is a symbolic " \
           "link or not a folder" in out, out[-3000:]
    assert "Traceback" not in out
    assert [p.name for p in ckpts.iterdir()] == ["step-2"]  # the refused save left nothing


def launch(run_dir: Path, *extra: str) -> tuple[int, str]:
    """``dtrain launch --nproc-per-node 2 -- python -m trainer.train`` (dp 2)."""
    done = run_dtrain(["launch", "--nproc-per-node", "2", "--", *forked_python(), "-m",
                       "trainer.train", *FLAGS, "--run-dir", str(run_dir), *extra], timeout=240)
    return done.returncode, done.stdout + done.stderr


def test_a_new_run_in_a_run_dir_holding_checkpoints_is_refused_once_before_anything_is_built(
        archive: Path, tmp_path: Path) -> None:
    run_dir = Path(shutil.copytree(archive.parent, tmp_path / "run"))
    before = snapshot(run_dir)
    code, out = launch(run_dir, "--steps", "2")
    assert code == 2, out[-3000:]
    [line] = [ln for ln in out.splitlines() if re.match(r"\[\d+@", ln) and "error:" in ln]
    assert f"[0@localhost] error: run dir holds another run's checkpoints [--run-dir " \
           f"{run_dir}]: 2 committed checkpoint(s), the newest " \
           f"{run_dir / 'checkpoints' / 'step-2'}; a new run would mix its checkpoints with " \
           "them" in line, line
    assert line.endswith("Add --resume to continue that run, pass a new --run-dir, or add "
                         f"--overwrite to move its checkpoints and metrics into {run_dir}/"
                         "replaced-<time>/ and start anew")
    assert "parameters" not in out  # refused before the model (or the data) was built
    assert snapshot(run_dir) == before


def test_overwrite_moves_the_previous_run_aside_and_starts_anew(archive: Path,
                                                               tmp_path: Path) -> None:
    run_dir = Path(shutil.copytree(archive.parent, tmp_path / "run"))
    before = snapshot(run_dir)
    code, out = train(run_dir, "--steps", "3", "--overwrite", "--keep", "0")
    assert code == 0, out[-3000:]
    [aside] = run_dir.glob("replaced-*")
    assert re.fullmatch(r"replaced-\d{8}-\d{6}-[0-9a-f]{4}", aside.name)
    assert f"--overwrite moved the previous run's checkpoints, metrics.jsonl to {aside}" in out
    assert snapshot(aside) == {k: v for k, v in before.items()
                               if k.startswith("checkpoints/") or k == "metrics.jsonl"}
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-3"]
    assert [r["step"] for r in read_records(run_dir / "metrics.jsonl")] == [1, 2, 3]


def test_overwrite_and_resume_together_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"--overwrite with --resume \[--overwrite --resume\]"):
        parse_args(["--overwrite", "--resume"])


def test_the_recommender_refuses_a_run_dir_holding_checkpoints_too(tmp_path: Path) -> None:
    def recsys(*extra: str) -> tuple[int, str]:
        done = subprocess.run([*forked_python(), "-m", "trainer.recsys", "--steps", "2",
                               "--rows", "1024", "--global-batch", "64", "--eval-every", "0",
                               "--run-dir", str(tmp_path), *extra], capture_output=True,
                              text=True, cwd=REPO, env=dtrain_env(), timeout=240, check=False)
        return done.returncode, done.stdout + done.stderr

    assert recsys()[0] == 0
    code, out = recsys()
    assert code == 2 and out.count("error: run dir holds another run's checkpoints") == 1, out
    code, out = recsys("--overwrite")
    assert code == 0, out[-3000:]
    assert "--overwrite moved the previous run's checkpoints, metrics.jsonl to " in out


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs, mounted for the test and unmounted after it: a disk that fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs", str(mount)],
                   check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_during_a_save_is_one_error_naming_the_folder_and_the_free_space(
        small_disk: Path) -> None:
    run_dir = small_disk / "run"
    # Leave two pages: the metrics file fits, the checkpoint and the loss plot do not.
    (small_disk / "filler").write_bytes(b"x" * (256 - 8) * 1024)
    code, out = train(run_dir, "--steps", "2")
    assert code == 2, out[-3000:]
    ckpts = run_dir / "checkpoints"
    [error] = [line for line in out.splitlines() if "error" in line.lower()]
    assert re.fullmatch(
        rf"error: checkpoint save failed \[{ckpts / 'step-2'}\]: no space left on device "
        # The free space is what the disk has at that moment: the loss plot, written beside the
        # background save, may hold the last pages then (0 bytes) or have let them go (KiB).
        rf"\([\d.]+ (bytes|KiB) free on the file system of {ckpts} after removing the partial "
        r"save; no "
        r"checkpoint is committed\)\. Free space there, or pass a --run-dir on a larger disk, "
        r"then --resume", error), error
    [warning] = [line for line in out.splitlines() if "loss.png" in line]
    assert warning == f"warning: loss.png not written [{run_dir / 'loss.png'}]: No space left " \
                      "on device. Its data are kept"
    assert "Traceback" not in out
    assert sorted(p.name for p in run_dir.rglob("*")) == ["checkpoints", "metrics.jsonl"]
    assert [r["step"] for r in read_records(run_dir / "metrics.jsonl")] == [1, 2]


class Planted:
    """What a hostile checkpoint file holds: unpickling it makes the folder ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.path),)


def test_a_planted_pickle_is_refused_as_hostile_even_when_torch_is_told_to_unpickle_anything(
        archive: Path, tmp_path: Path) -> None:
    run_dir = Path(shutil.copytree(archive.parent, tmp_path / "run"))
    step, canary = run_dir / "checkpoints" / "step-2", tmp_path / "code-ran"
    shard = step / "rank-00000.safetensors"
    torch.save({"tok_emb.weight": Planted(canary)}, shard)
    record = json.loads((step / "COMMITTED").read_text())  # whoever plants can rewrite it too
    record["files"][shard.name] = {"size": shard.stat().st_size,
                                   checksum.WRITTEN: checksum.of_file(shard, checksum.WRITTEN)}
    (step / "COMMITTED").write_text(json.dumps(record))
    code, out = train(run_dir, "--steps", "3", "--resume",
                      env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})
    assert code == 2, out[-3000:]
    assert not canary.exists()
    [line] = [line for line in out.splitlines() if "error" in line]
    assert line.startswith(f"error: checkpoint file is not a safetensors file [{shard}]: "), line
    assert "it may be a pickle or another format put in its place" in line
    assert line.endswith("Restore the checkpoint from a copy you trust, or start a new "
                         "--run-dir")


def test_pictures_that_cannot_be_written_after_a_finished_run_are_one_warning_each(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    taken = ["expert_load.png", "timeline.json", "timeline.png"]
    for name in taken:  # a folder of the user's in the place of each picture
        (run_dir / name).mkdir(parents=True)
        (run_dir / name / "keep").write_text(name)
    code, out = launch(run_dir, "--steps", "2", "--pp", "2", "--n-layer", "2",
                       "--moe-experts", "2")
    assert code == 0, out[-3000:]
    assert "Traceback" not in out
    for name in taken:
        [warning] = [line for line in out.splitlines() if f"{name} not written" in line]
        assert warning.endswith(f"warning: {name} not written [{run_dir / name}]: Is a "
                                "directory. Its data are kept"), warning
        assert (run_dir / name / "keep").read_text() == name
    assert (run_dir / "loss.png").stat().st_size > 0
    assert not [p.name for p in run_dir.iterdir() if ".tmp-" in p.name]
