"""The checkpoint kill matrix: a tp 2 run through ``dtrain launch`` is SIGKILLed at every point
of a save and of the pruning that follows it (`trainer.checkpoint.fault.POINTS`), then
``--resume`` continues from the newest committed checkpoint, saves and prunes again, finishes
with exit 0, and ends bit-identical to a run that was never interrupted.

Every point is run twice: with saves written in place (``--no-async-save``) and in the
background (``--async-save``: the writer's thread reaches the point, and kills the process,
while the training thread runs the next step). The points of a background write: staged
(``save_after_stage``), partly written (``save_after_write`` on one rank, ``save_after_tensors``,
``save_after_rng``), written not fsynced (``save_after_write``), fsynced not committed
(``save_after_meta``, ``save_after_rename``), committed (``save_after_marker``), during pruning
(``remove_after_marker``, ``remove_mid_files``, ``prune_after_remove``). Both modes resume to
the state of the uninterrupted run written in place.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support import run_dtrain
from tests.support.mpi_runs import forked_python
from tests.support.saved import same_states, saved_state
from trainer import checkpoint
from trainer.checkpoint import POINTS, rank_file
from trainer.training.metrics import read_records

STEPS, KILLED_AT, KEEP = 4, 3, 2  # saving step 3 prunes step 1: every point is reached
FLAGS = ["--model", "tiny", "--n-layer", "1", "--d-model", "32", "--seq-len", "32",
         "--global-batch", "4", "--dropout", "0.1", "--steps", str(STEPS), "--warmup-steps",
         "1", "--data-cap-mb", "0.25", "--log-every", "1", "--tp", "2", "--save-every", "1",
         "--keep", str(KEEP)]
#: What the checkpoint folder holds after the kill at each point (the point was reached).
ON_DISK = {
    **dict.fromkeys(("save_after_stage", "save_after_write", "save_after_tensors",
                     "save_after_rng", "save_after_meta"),
                    ["step-1", "step-2", "step-3.tmp"]),
    "save_after_rename": ["step-1", "step-2", "step-3 uncommitted"],
    "save_after_marker": ["step-1", "step-2", "step-3"],
    **dict.fromkeys(("remove_after_marker", "remove_mid_files"),
                    ["step-1 uncommitted", "step-2", "step-3"]),
    "prune_after_remove": ["step-2", "step-3"],
}

MODES = ("--no-async-save", "--async-save")
PRUNING = ("remove_after_marker", "remove_mid_files", "prune_after_remove")
"""Points of the pruning, which a background save runs after it finished
(`trainer.checkpoint.writer`): by the time the leader's thread reaches one, the other rank may
have begun writing the next save (step 4), whose temporary folder the kill then leaves too (a
dead save's leftover, never read, pruned by the resumed run)."""


def launch(run_dir: Path, *extra: str, fault: str = "") -> subprocess.CompletedProcess[str]:
    env = ["--env", f"DTRAIN_FAULT={fault}"] if fault else []
    return run_dtrain(["launch", "--nproc-per-node", "2", *env, "--", *forked_python(), "-m",
                       "trainer.train", *FLAGS, "--run-dir", str(run_dir), *extra], timeout=240)


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_records(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    done = launch(run_dir, "--no-async-save")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


def on_disk(ckpts: Path) -> list[str]:
    """The folder's entries: ``step-N``, ``step-N uncommitted``, ``step-N.tmp``."""
    def label(path: Path) -> str:
        if ".tmp-" in path.name:
            return path.name.partition(".tmp-")[0] + ".tmp"
        return path.name + ("" if (path / checkpoint.MARKER).exists() else " uncommitted")

    return sorted(label(p) for p in ckpts.iterdir())


def test_the_matrix_covers_every_fault_point() -> None:
    assert sorted(ON_DISK) == sorted(POINTS)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("point", POINTS)
def test_a_run_killed_at_this_point_resumes_saves_again_and_matches_an_uninterrupted_one(
        point: str, mode: str, uninterrupted: Path, tmp_path: Path) -> None:
    killed = launch(tmp_path, mode, fault=f"{point}@{KILLED_AT}")
    out = killed.stdout + killed.stderr
    assert killed.returncode != 0 and "killed by SIGKILL" in out, out[-3000:]
    ckpts = tmp_path / "checkpoints"
    left = on_disk(ckpts)
    if mode == "--async-save" and point in PRUNING and "step-4.tmp" in left:
        left.remove("step-4.tmp")
    assert left == ON_DISK[point]
    resume_at = KILLED_AT if "step-3" in ON_DISK[point] else KILLED_AT - 1
    assert checkpoint.latest(ckpts) == ckpts / f"step-{resume_at}"

    resumed = launch(tmp_path, mode, "--resume")
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-3000:]
    assert f"resumed at step {resume_at}" in out
    # Saved and pruned again: the newest KEEP steps, no temporaries or marker-less leftovers.
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-3", "step-4"]
    assert losses(tmp_path) == losses(uninterrupted)
    # Read back (every file verified): the same weights and moments, bit for bit.
    assert same_states(saved_state(ckpts / f"step-{STEPS}"),
                       saved_state(uninterrupted / "checkpoints" / f"step-{STEPS}")) == []
    assert (ckpts / "step-4" / rank_file(1)).is_file()
