"""Validation loss, communication time and sampling of real runs at every layout.

One training is run four times through ``dtrain launch`` on localhost, with the same options
and seed: serially (1 rank), at tp 2, at pp 2 and at dp 2 x tp 2 x pp 2 (8 ranks). Then:

* the validation loss is in ``metrics.jsonl`` at every ``--eval-every`` step and at the end,
  finite, and the same at every layout as serially;
* TP and PP communication is counted: every step of the parallel runs has exposed comm > 0
  and total >= exposed (`trainer.comm.timing`); ``loss.png`` is drawn;
* ``python -m trainer.generate`` merges the checkpoint of every layout into the serial GPT,
  whose validation loss is the one the parallel run logged at its last step (same parameters,
  other summation order), and samples exactly what that merged model samples in this process.

Tolerances (fp32 runs, as users run them; derived in tests/support/numerics.py, not tuned). The
layouts
change only the order of sums, so a loss computed from the same parameters (the first step's,
or a merged checkpoint evaluated here) agrees to the forward bound: each of the model's
2 x n_layer + 2 stages of sums (at most 4 x d_model = 256 terms) adds 2(n-1)u relative error,
and the mean over the tokens adds its own. Losses after updates also carry the rounded updates:
to first order at most lr x Σ δ per step (`loss_atol`), a loose bound for fp32 runs that still
catches a layout training on wrong data or shards; the exact equivalence of training across
layouts is shown in fp64 by tests/trainer/test_tp_training.py and tests/trainer/test_pp_training.py.
"""

from __future__ import annotations

import functools
import math
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support import REPO, dtrain_env, run_dtrain
from tests.support.mpi_runs import forked_python
from tests.support.numerics import U32, reduction_rtol
from tests.support.serial_reference import bounds, train_serially
from trainer.checkpoint import latest
from trainer.config.options import parse_args
from trainer.data.batches import BatchPlan, ShardedBatches
from trainer.data.corpus import load_corpus
from trainer.inference.merge import load_serial
from trainer.inference.sampling import sample
from trainer.model.config import PRESETS
from trainer.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from trainer.training.metrics import read_records

STEPS, LR, EVAL_EVERY = 8, 3e-3, 3
FLAGS = ["--model", "tiny", "--steps", str(STEPS), "--global-batch", "8", "--microbatches", "2",
         "--lr", str(LR), "--warmup-steps", "1", "--eval-every", str(EVAL_EVERY),
         "--eval-batches", "2", "--data-cap-mb", "0.25", "--log-every", "4", "--seed", "7"]
LAYOUTS = {"serial": (1, []), "tp2": (2, ["--tp", "2"]), "pp2": (2, ["--pp", "2"]),
           "dp2tp2pp2": (8, ["--tp", "2", "--pp", "2"])}
TINY = PRESETS["tiny"]  # --model tiny
TOKENS_PER_STEP = 8 * TINY.seq_len
FORWARD_RTOL = ((2 * TINY.n_layer + 2) * reduction_rtol(4 * TINY.d_model, U32)
                + reduction_rtol(2 * TOKENS_PER_STEP, U32))  # + the mean over <= 2 batches
PROMPT, TOKENS = "def __init__(self", 24


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The run folder of every layout."""
    out = {}
    for name, (nproc, flags) in LAYOUTS.items():
        run_dir = tmp_path_factory.mktemp(name)
        res = run_dtrain(["launch", "--nproc-per-node", str(nproc), "--", *forked_python(),
                          "-m", "trainer.train", *FLAGS, *flags, "--run-dir", str(run_dir)],
                         timeout=600)
        assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
        out[name] = run_dir
    return out


@functools.cache
def serial_reference() -> dict:
    """The single-process fp32 run of FLAGS, for its measured gradient scale."""
    return train_serially(parse_args(FLAGS, quiet=True), STEPS, fp64=False)


def records(run_dir: Path) -> list[dict]:
    return read_records(run_dir / "metrics.jsonl")


def test_the_validation_loss_is_logged_at_every_eval_step_and_at_the_end(runs) -> None:
    for name, run_dir in runs.items():
        evals = {r["step"]: r["val_loss"] for r in records(run_dir) if r["val_loss"] is not None}
        assert sorted(evals) == [3, 6, 8], name
        assert all(math.isfinite(v) and 0 < v < math.log(256) + 1 for v in evals.values()), name
    assert (runs["serial"] / "loss.png").stat().st_size > 0


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2tp2pp2"])
def test_every_layout_has_the_serial_validation_and_training_losses(runs, layout: str) -> None:
    want, got = records(runs["serial"]), records(runs[layout])
    assert got[0]["loss"] == pytest.approx(want[0]["loss"], rel=FORWARD_RTOL)  # same parameters
    for key in ("loss", "val_loss"):
        a = [(r["step"], r[key]) for r in want if r[key] is not None]
        b = [(r["step"], r[key]) for r in got if r[key] is not None]
        assert [s for s, _ in b] == [s for s, _ in a], (layout, key)
        for (step, x), (_, y) in zip(a, b, strict=True):
            atol = bounds(serial_reference(), steps=step, lr=LR,
                          n_terms=TOKENS_PER_STEP + 4 * TINY.d_model, unit=U32).loss
            assert y == pytest.approx(x, rel=FORWARD_RTOL, abs=atol), (layout, key, step)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2tp2pp2"])
def test_tp_and_pp_communication_is_counted_and_total_is_never_below_exposed(
        runs, layout: str) -> None:
    for r in records(runs[layout]):
        assert r["comm_exposed_s"] > 0, (layout, r)
        assert r["comm_total_s"] >= r["comm_exposed_s"], (layout, r)
        assert r["compute_s"] == pytest.approx(r["step_s"] - r["comm_exposed_s"])


def generate(run_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*forked_python(), "-m", "trainer.generate", "--run-dir", str(run_dir),
                           "--prompt", PROMPT, "--tokens", str(TOKENS), "--temperature", "0"],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=dtrain_env())


def serial_val_loss(model: torch.nn.Module) -> float:
    """The validation loss as the trainer computes it, on one process (2 batches of 8 windows
    in 2 microbatches, the run's seed and data)."""
    corpus = load_corpus(cap_bytes=int(0.25 * 2**20))
    batches = ShardedBatches(corpus, seq_len=model.cfg.seq_len, plan=BatchPlan(8, 1, 2), seed=7,
                             dp_rank=0, validation=True)
    with torch.no_grad():
        return sum(float(model.loss(x, y)) for k in range(2) for x, y in batches.microbatches(k)
                   ) / 4


def refuse(*_: object, **__: object) -> None:
    raise AssertionError("the merge built a parallel model")


@pytest.mark.parametrize("layout", ["serial", "tp2", "pp2", "dp2tp2pp2"])
def test_a_checkpoint_of_any_layout_merges_into_the_model_that_run_evaluated(
        runs, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the index alone: no parallel layer is built to learn where the weights were cut."""
    for layer in (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding):
        monkeypatch.setattr(layer, "__init__", refuse)
    model, meta = load_serial(latest(runs[layout] / "checkpoints"))
    nproc, _ = LAYOUTS[layout]
    assert meta["layout"]["tp"] * meta["layout"]["pp"] * meta["layout"]["dp"] == nproc
    logged = records(runs[layout])[-1]["val_loss"]
    assert serial_val_loss(model) == pytest.approx(logged, rel=FORWARD_RTOL)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2tp2pp2"])
def test_a_tp_pp_or_3d_checkpoint_samples_what_its_merged_serial_model_samples(
        runs, layout: str) -> None:
    got = generate(runs[layout])
    assert got.returncode == 0, got.stderr
    model, _ = load_serial(latest(runs[layout] / "checkpoints"))
    want = sample(model, PROMPT.encode(), tokens=TOKENS, temperature=0)
    assert got.stdout.encode().startswith(PROMPT.encode())
    assert got.stdout.rstrip("\n").encode()[len(PROMPT):] == want.decode(
        "utf-8", errors="replace").encode()


def test_sampling_without_a_checkpoint_names_the_folder_once(tmp_path: Path) -> None:
    res = generate(tmp_path)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("error: no checkpoint to sample from") == 1
    assert f"[{tmp_path / 'checkpoints'}]" in res.stderr
