"""Tensor-parallel training equals the single-process model, for tp in {1, 2, 4} x dp in {1, 2}.

The worker (`tests.support.tp_workers.worker`, one ``mpiexec`` run per world size 1, 2 and 4)
trains each
case of `tests.support.tp_workers.cases` at every layout of its world with the trainer's own
``build_run``/``train_step`` (dropout off, clipping on) and re-assembles the sharded parameters;
the single-process reference is computed here with the plain model, the whole global batch and
torch's ``clip_grad_norm_``. Both sides run in fp64 and TP and DP change only the order of sums,
so the tolerances are the fp64 bounds of tests/support/numerics.py: losses to the reduction bound
plus
the first-order effect of rounded updates, the first step's gradient norm (computed before any
update) to the reduction bound, parameters to the reduction bound carried through Adam. Every
case clips, so a wrong norm at a later step would scale that step's update and fail the
parameter test. A wrong shard or a missing reduction moves parameters by O(lr) = 3e-3.

Then dropout (masks identical across TP ranks outside TP regions, different inside them) and
checkpoints of a tp 2 x dp 2 run through ``python -m trainer.train``: every rank writes a
share, bit-exact resume, and the checkpoint resumed on one process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.support.mpi_runs import run_ranks, world_run
from tests.support.numerics import f64, reduction_rtol
from tests.support.serial_reference import Bounds, bounds
from tests.support.tp_workers.cases import (
    CASES,
    CKPT_CASE,
    STEPS,
    WORKER,
    case_config,
    cli_flags,
    layouts,
    serial_reference,
)
from trainer.checkpoint.pieces import assemble
from trainer.config.options import parse_args
from trainer.training.metrics import read_records

TOKENS = 8 * 16 + 32  # global batch x seq_len, + d_model: the longest sum in any element
RTOL = reduction_rtol(TOKENS)


def tolerances(case: str) -> Bounds:
    return bounds(serial_reference(case), steps=STEPS, lr=case_config(case).optimizer.lr,
                  n_terms=TOKENS)


LAYOUTS = [(world, tp, dp) for world in (1, 2, 4) for tp, dp in layouts(world)]


def layout_id(item: tuple[int, int, int]) -> str:
    return f"tp{item[1]}dp{item[2]}"


@pytest.fixture(scope="module", params=LAYOUTS, ids=layout_id)
def layout(request: pytest.FixtureRequest) -> tuple[int, int, list[dict]]:
    """(tp, dp, what every rank trained at that layout)."""
    world, tp, dp = request.param
    return tp, dp, [r[f"tp{tp}dp{dp}"] for r in world_run(WORKER, world).ranks]


@pytest.mark.parametrize("case", list(CASES))
def test_losses_match_the_single_process_model(layout: tuple, case: str) -> None:
    _, _, ranks = layout
    for rank in ranks:
        torch.testing.assert_close(f64(rank[case]["losses"]),
                                   f64(serial_reference(case)["losses"]),
                                   rtol=RTOL, atol=tolerances(case).loss)


@pytest.mark.parametrize("case", list(CASES))
def test_grad_norm_counts_replicated_parameters_once_and_equals_the_serial_norm(
        layout: tuple, case: str) -> None:
    _, _, ranks = layout
    for rank in ranks:
        torch.testing.assert_close(rank[case]["norms"][0], serial_reference(case)["norms"][0],
                                   rtol=RTOL, atol=tolerances(case).norm)


@pytest.mark.parametrize("case", list(CASES))
def test_reassembled_parameters_match_the_single_process_model(layout: tuple, case: str) -> None:
    _, _, ranks = layout
    expected = serial_reference(case)["params"]
    got = ranks[0][case]["params"]
    assert got.keys() == expected.keys()
    for name, want in expected.items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=tolerances(case).params,
                                   msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_ends_with_bit_identical_reassembled_parameters(layout: tuple,
                                                                   case: str) -> None:
    _, _, ranks = layout
    first = ranks[0][case]["params"]
    for rank in ranks[1:]:
        assert all(torch.equal(rank[case]["params"][n], first[n]) for n in first)


def test_each_tp_rank_holds_only_its_shard(layout: tuple) -> None:
    tp, _, ranks = layout
    shapes = ranks[0]["untied"]["local_shapes"]
    assert shapes["blocks.0.attn.qkv.weight"] == (3 * 32 // tp, 32)
    assert shapes["blocks.0.mlp.proj.weight"] == (32, 128 // tp)
    assert shapes["tok_emb.weight"] == shapes["head.weight"] == (256 // tp, 32)
    assert shapes["blocks.0.mlp.proj.bias"] == (32,)       # row-parallel bias: replicated


# -- dropout ---------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"tp{n}")
def dropout(request: pytest.FixtureRequest) -> list[dict]:
    return [r["dropout"] for r in world_run(WORKER, request.param).ranks]


def _same_everywhere(ranks: list[dict], run: str, key: str) -> bool:
    return all(torch.equal(r[run][key], ranks[0][run][key]) for r in ranks[1:])


def test_dropout_outside_tp_regions_is_identical_on_every_tp_rank(dropout: list[dict]) -> None:
    emb = dropout[0]["model"]["emb"]
    assert 0.1 < (emb == 0).float().mean() < 0.3  # dropout 0.2 really ran
    for key in ("emb", "block0", "block1"):
        assert _same_everywhere(dropout, "model", key), key
        assert _same_everywhere(dropout, "same_heads", key), key


def test_attention_dropout_inside_tp_regions_differs_between_tp_ranks(dropout: list[dict]
                                                                      ) -> None:
    """Every rank is given the same heads: their attention outputs then differ only through
    the probability masks, which come from the per-rank TP stream."""
    for key in ("heads0", "heads1"):
        assert not any(torch.equal(r["same_heads"][key], dropout[0]["same_heads"][key])
                       for r in dropout[1:]), key
        assert _same_everywhere(dropout, "same_heads_eval", key), key       # no dropout
        assert _same_everywhere(dropout, "same_heads_one_seed", key), key   # same TP seed


# -- checkpoints through the training entry --------------------------------------------------



def run_train(n: int, flags: list[str]) -> tuple[int, str]:
    done = run_ranks(n, ["-m", "trainer.train", *flags])
    return done.returncode, done.stdout


@pytest.fixture(scope="module")
def tp_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tp 2 x dp 2 (4 ranks): train to step 2 and checkpoint, then resume and finish."""
    run_dir = tmp_path_factory.mktemp("tp2dp2")
    flags = [*cli_flags(CKPT_CASE), "--tp", "2", "--run-dir", str(run_dir), "--save-every", "1"]
    code, out = run_train(4, [*flags, "--stop-at", "2"])
    assert code == 0, out[-3000:]
    code, out = run_train(4, [*flags, "--resume"])
    assert code == 0, out[-3000:]
    assert "resumed at step 2" in out and "dp 2 x tp 2" in out
    return run_dir


def test_every_rank_writes_a_share_of_the_slices_not_only_dp_rank_0(tp_run_dir: Path) -> None:
    step = tp_run_dir / "checkpoints" / "step-2"
    assert sorted(p.name for p in step.iterdir()) == [
        "COMMITTED", "index.json", "meta.json", *(f"rank-{r:05d}.safetensors" for r in range(4)),
        "rng.safetensors"]


def test_resumed_tp_dp_run_is_bit_identical_to_an_uninterrupted_one(tp_run_dir: Path) -> None:
    uninterrupted = world_run(WORKER, 4).ranks[0]["fp32-tp2dp2"]
    losses = [r["loss"] for r in read_records(tp_run_dir / "metrics.jsonl")]
    assert len(losses) == STEPS
    assert losses == uninterrupted["losses"]  # exact: same floats, not just close
    saved = assemble(tp_run_dir / "checkpoints" / f"step-{STEPS}")
    assert saved.keys() == uninterrupted["params"].keys()
    assert all(torch.equal(saved[n], full) for n, full in uninterrupted["params"].items())


def test_a_tp2_checkpoint_resumes_on_one_process(tp_run_dir: Path, tmp_path: Path) -> None:
    run_dir = Path(shutil.copytree(tp_run_dir, tmp_path / "run"))
    code, out = run_train(1, [*cli_flags(CKPT_CASE), "--tp", "1", "--run-dir", str(run_dir),
                              "--steps", str(STEPS + 1), "--resume"])
    assert code == 0, out[-3000:]
    assert f"resumed at step {STEPS} with changed options: tp 2 -> 1" in out


def test_the_training_entry_accepts_tp() -> None:
    assert parse_args(["--tp", "2"]).parallel.tp == 2


@pytest.mark.parametrize("world", [2, 4], ids=lambda n: f"tp{n}")
def test_a_shard_that_cannot_be_written_fails_every_writer_and_commits_nothing(world: int
                                                                               ) -> None:
    for rank in world_run(WORKER, world).ranks:
        got = rank["checkpoint_failure"]
        assert got["latest"] is None
        assert got["message"].startswith("checkpoint save failed [")
        if rank["rank"] == 1:
            assert "cannot hold dtype torch.complex64" in got["message"], got["message"]
        else:
            assert "another writer (rank 1) failed to write its tensor file" in got["message"]
