"""The non-finite guard: a diverging run stops on every rank in the same step with one message
and a non-zero exit, writes no checkpoint of the bad state and prunes none of the good ones."""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support import REPO, dtrain_env, run_dtrain
from tests.support.mpi_runs import forked_python
from tests.support.saved import same_states, saved_state
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.training.guard import DivergedError, StepGuard, check_parameters
from trainer.training.metrics import read_records
from trainer.training.startup import fail_alone

# Adam at lr 1e4 with no warmup and no clipping: the loss is NaN within a few steps.
DIVERGING = ["--model", "tiny", "--n-layer", "1", "--d-model", "32", "--seq-len", "32",
             "--global-batch", "4", "--steps", "12", "--data-cap-mb", "0.25", "--log-every", "1",
             "--lr", "1e4", "--min-lr", "1e4", "--warmup-steps", "0", "--grad-clip", "0",
             "--save-every", "1", "--keep", "2"]


def test_a_finite_step_is_applied() -> None:
    assert StepGuard().admit(3, 2.5, 1e30, report=True)


@pytest.mark.parametrize(("loss", "norm"), [(math.nan, 1.0), (1.0, math.inf),
                                            (-math.inf, math.nan)])
def test_a_nan_or_inf_loss_or_norm_stops_every_rank_and_one_reports(loss: float, norm: float
                                                                    ) -> None:
    for report in (True, False):
        with pytest.raises(DivergedError, match=r"^training diverged \[step 7\]: the loss is "
                           r".* and the global gradient norm .*; the step was not applied") as err:
            StepGuard().admit(7, loss, norm, report=report)
        assert err.value.agreed and err.value.report is report


def test_skip_nonfinite_drops_up_to_n_steps_then_stops_naming_them(
        capsys: pytest.CaptureFixture[str]) -> None:
    guard = StepGuard(allowed=2)
    assert not guard.admit(4, math.nan, 1.0, report=True)
    assert guard.admit(5, 1.0, 1.0, report=True)
    assert not guard.admit(6, 1.0, math.inf, report=False)
    with pytest.raises(DivergedError, match=r"\[step 9\]: the loss is nan and the global gradient "
                       r"norm nan after skipping steps 4, 6; the step was not applied"):
        guard.admit(9, math.nan, math.nan, report=True)
    assert capsys.readouterr().err == ("dtrain: step 4 skipped: the loss is nan and the global "
                                       "gradient norm 1.0 (1 of --skip-nonfinite 2)\n")


def test_parameters_that_overflowed_in_the_update_are_not_saved() -> None:
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8), seed=0)
    check_parameters(model.parameters(), 4, None, report=True)
    with torch.no_grad():
        next(model.parameters())[0, 0] = math.inf
    with pytest.raises(DivergedError, match=r"\[step 4\]: a parameter is NaN or infinite after "
                       r"the update; the checkpoint of this step is not written"):
        check_parameters(model.parameters(), 4, None, report=True)


def test_an_agreed_error_is_printed_only_by_the_reporting_rank(
        capsys: pytest.CaptureFixture[str]) -> None:
    quiet = DivergedError("training diverged", "step 2", "nan").everywhere(report=False)
    assert fail_alone(None, f"error: {quiet}", 2, quiet) == 2
    loud = DivergedError("training diverged", "step 2", "nan").everywhere(report=True)
    assert fail_alone(None, f"error: {loud}", 2, loud) == 2
    assert capsys.readouterr().err == "error: training diverged [step 2]: nan\n"


def test_a_diverging_dp2_tp2_run_stops_together_keeps_its_good_checkpoints_and_saves_no_nan(
        tmp_path: Path) -> None:
    done = run_dtrain(["launch", "--nproc-per-node", "4", "--", *forked_python(), "-m",
                       "trainer.train", *DIVERGING, "--tp", "2", "--run-dir", str(tmp_path)],
                      timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    said = [line for line in out.splitlines()
            if re.match(r"\[\d+@", line) and "error:" in line]
    assert len(said) == 1, said  # printed once, not by each of the 4 ranks
    match = re.search(r"\[0@localhost\] \[rank 0\] error: training diverged \[step (\d+)\]: the "
                      r"loss is (nan|-?inf) and the global gradient norm", said[0])
    assert match, said[0]
    bad = int(match.group(1))
    assert bad >= 3  # so keep=2 had two good checkpoints to lose
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl")] == \
        list(range(1, bad))
    ckpts = tmp_path / "checkpoints"
    # Nothing of the bad step was written and no good checkpoint was pruned for it.
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step-{bad - 2}", f"step-{bad - 1}"]
    last = saved_state(ckpts / f"step-{bad - 1}")  # loads: checksums verify, values are finite
    assert all(bool(torch.isfinite(v).all()) for kind in last.values() for v in kind.values())


def test_skip_nonfinite_drops_the_updates_of_diverged_steps_then_stops(tmp_path: Path) -> None:
    """One process: the skipped steps leave parameters and optimizer state untouched, so the
    checkpoints of the skipped steps hold exactly the last applied step's state."""
    done = subprocess.run([*forked_python(), "-m", "trainer.train", *DIVERGING, "--run-dir",
                           str(tmp_path), "--skip-nonfinite", "2"], capture_output=True,
                          text=True, cwd=REPO, env=dtrain_env(), timeout=240, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    skips = re.findall(r"dtrain: step (\d+) skipped: the loss is ", done.stderr)
    assert len(skips) == 2, done.stderr[-3000:]
    first, second = map(int, skips)
    stop = re.search(rf"error: training diverged \[step (\d+)\]: .* after skipping steps "
                     rf"{first}, {second}; the step was not applied", done.stderr)
    assert stop, done.stderr[-3000:]
    assert second == first + 1 and int(stop.group(1)) == second + 1  # stays diverged
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step-{first}", f"step-{second}"]
    before, after = (saved_state(ckpts / f"step-{s}") for s in (first, second))
    assert same_states(before, after) == []
