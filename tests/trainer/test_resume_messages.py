"""What a user is told when a run resumes in another shape or its data holds nothing, as the
user meets it (real processes): a recommender resumed at another rank count stops with one
error and no MPI abort; ``prepare`` of empty files is refused there; a MoE run resumed with
another number of sequences per microbatch warns that its auxiliary objective changes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.support import PYTHON, REPO, dtrain_env, run_dtrain
from tests.support.mpi_runs import forked_python

RECSYS = ["-m", "trainer.recsys", "--rows", "1024", "--global-batch", "64", "--eval-every", "0"]


def test_a_recommender_resumed_at_another_rank_count_stops_with_one_error_and_no_abort(
        tmp_path: Path) -> None:
    done = subprocess.run([*forked_python(), *RECSYS, "--steps", "2", "--run-dir",
                           str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                          env=dtrain_env(), timeout=240, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    done = run_dtrain(["launch", "--nproc-per-node", "2", "--", *forked_python(), *RECSYS,
                       "--steps", "3", "--resume", "--run-dir", str(tmp_path)], timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    # The ranks' own lines ("[rank@host] ..."): the launcher's summary quotes the failed
    # rank's last stderr lines once more, after them.
    errors = [line for line in out.splitlines()
              if re.match(r"\[\d+@\S+\] ", line) and "error:" in line]
    assert len(errors) == 1, "\n".join(errors)
    assert "error: checkpoint does not match this run [" in errors[0], errors[0]
    assert "ranks: checkpoint 1, now 2 (the table is sharded over them)" in errors[0]
    assert "abort" not in out.lower(), out[-3000:]


def test_prepare_of_only_empty_files_is_refused_there(tmp_path: Path) -> None:
    empty = [tmp_path / "a.txt", tmp_path / "b.jsonl"]
    for path in empty:
        path.write_text("" if path.suffix == ".txt" else "\n\n")
    done = subprocess.run([PYTHON, "-m", "trainer.data.prepare", "--input", *map(str, empty),
                           "--out", str(tmp_path / "ds"), "--train-bpe", "300", "--quiet"],
                          capture_output=True, text=True, cwd=REPO, env=dtrain_env(),
                          timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (f"error: no text to tokenize [{empty[0]}, {empty[1]}]: the 2 input "
                           "file(s) hold no text (empty files or documents), so the dataset "
                           "would hold no training window. Pass files with text in them\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.jsonl"]


MOE = ["--model", "tiny", "--n-layer", "2", "--d-model", "32", "--seq-len", "16",
       "--global-batch", "4", "--moe-experts", "2", "--eval-every", "0", "--data-cap-mb",
       "0.25", "--warmup-steps", "1"]


def moe_train(run_dir: Path, *extra: str) -> str:
    done = subprocess.run([*forked_python(), "-m", "trainer.train", *MOE, "--run-dir",
                           str(run_dir), *extra], capture_output=True, text=True, cwd=REPO,
                          env=dtrain_env(), timeout=240, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout + done.stderr


def test_a_moe_run_resumed_with_other_microbatches_warns_that_its_auxiliary_loss_changes(
        tmp_path: Path) -> None:
    moe_train(tmp_path, "--steps", "2")
    same = moe_train(tmp_path, "--steps", "3", "--resume")
    assert "resumed at step 2" in same and "warning: MoE" not in same, same[-3000:]
    other = moe_train(tmp_path, "--steps", "4", "--resume", "--microbatches", "2")
    [line] = [line for line in other.splitlines() if line.startswith("warning: MoE")]
    assert line == (
        "warning: MoE load balancing changes on resume [step-3]: the checkpoint trained with "
        "4 sequence(s) per microbatch (global batch 4 over dp 1 x 1 microbatches), this run "
        "with 2; the load-balancing loss is computed per microbatch, over its tokens, so from "
        "here on the auxiliary objective is another one (the language-model loss is the "
        "same). Resume with dp x --microbatches = 1 to keep it")
