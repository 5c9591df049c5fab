"""A run's checkpoint folder linked to another disk, and what is named like a checkpoint but is
not one: a real training run lists, saves, prunes and resumes inside the link's target, never
touches a folder it did not write, and a --resume that finds only content it cannot use stops."""

from __future__ import annotations

from pathlib import Path

from tests.trainer.test_checkpoint_safety import snapshot, train


def test_a_linked_checkpoints_folder_is_saved_pruned_and_resumed_in_its_target_only(
        tmp_path: Path) -> None:
    disk = tmp_path / "big-disk" / "ckpts"
    mine = disk / "step-1"  # a folder of the user's, named like a step
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("not a checkpoint")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(disk)
    code, out = train(run_dir, "--steps", "4", "--save-every", "2", "--keep", "1")
    assert code == 0, out[-3000:]
    assert sorted(p.name for p in disk.iterdir()) == ["step-1", "step-4"]  # step-2 pruned
    assert (mine / "notes.txt").read_text() == "not a checkpoint"
    [warned] = [line for line in out.splitlines() if f"[{mine}]" in line]
    assert warned.startswith(f"warning: not a checkpoint folder [{mine}]: it is a folder "
                             "holding what no save writes (notes.txt)"), warned
    code, out = train(run_dir, "--steps", "5", "--resume")
    assert code == 0, out[-3000:]
    assert "resumed at step 4" in out, out[-3000:]
    assert "starting at step 0" not in out
    assert (disk / "step-5" / "COMMITTED").is_file()
    assert (mine / "notes.txt").read_text() == "not a checkpoint"


def test_a_resume_finding_only_checkpoints_it_cannot_use_stops_instead_of_starting_over(
        tmp_path: Path) -> None:
    archive = tmp_path / "archive"
    code, out = train(archive, "--steps", "2", "--save-every", "2")
    assert code == 0, out[-3000:]
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / "step-2").symlink_to(archive / "checkpoints" / "step-2")
    before = snapshot(archive)
    code, out = train(tmp_path / "run", "--steps", "3", "--resume")
    assert code == 2, out[-3000:]
    [line] = [line for line in out.splitlines() if "error" in line]
    assert line.startswith(f"error: no checkpoint to resume from [{ckpts}]: --resume found no "
                           "committed checkpoint it can use, only step-2 (a symbolic link to "
                           f"{archive / 'checkpoints' / 'step-2'})"), line
    assert line.endswith("Copy a checkpoint in (a folder, not a link) and --resume again, or "
                         "move them out and start the run without --resume"), line
    assert "Traceback" not in out and "step      1 |" not in out  # nothing trained
    assert snapshot(archive) == before
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-2"]


def test_a_link_to_a_missing_disk_is_refused_before_the_run_is_built(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(tmp_path / "unmounted")
    code, out = train(run_dir, "--steps", "1", "--resume")
    assert code == 2, out[-3000:]
    assert f"error: checkpoint folder is missing [--run-dir {run_dir}]: {run_dir}/checkpoints " \
           f"is a symbolic link to {tmp_path / 'unmounted'}, which does not exist" in out, out
    assert not (tmp_path / "unmounted").exists()
