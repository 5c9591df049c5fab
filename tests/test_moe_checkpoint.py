"""An ep 2 run through ``python -m trainer.train``: expert shards per EP rank, bit-exact resume,
refusal of another E or ep, and the expert load in the metrics file and its heat map.

Two ranks (dp 2 = ep 2): each holds 2 of the 4 experts of the MoE layer, so each writes its own
model and optimizer shard. The same run split at step 2 and resumed must give the very floats
of an uninterrupted run; the refusal names every difference at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.mpi_runs import run_ranks
from trainer.checkpoint import shard_name
from trainer.inference.merge import load_serial
from trainer.training.expert_load import PLOT_FILE
from trainer.training.metrics import read_records

STEPS = 3
FLAGS = ["--model", "tiny", "--n-layer", "2", "--n-head", "2", "--d-model", "32", "--seq-len",
         "16", "--moe-experts", "4", "--moe-topk", "2", "--global-batch", "8", "--steps",
         str(STEPS), "--lr", "3e-3", "--warmup-steps", "1", "--data-cap-mb", "0.25",
         "--eval-every", "0", "--log-every", "1", "--precision", "fp32"]


def run_train(flags: list[str]) -> tuple[int, str]:
    done = run_ranks(2, ["-m", "trainer.train", *FLAGS, *flags])
    return done.returncode, done.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(resumed run dir, uninterrupted run dir), both ep 2 on 2 ranks."""
    resumed, straight = tmp_path_factory.mktemp("ep2-resumed"), tmp_path_factory.mktemp("ep2")
    base = ["--ep", "2", "--save-every", "1", "--keep", "0"]
    code, out = run_train([*base, "--run-dir", str(resumed), "--stop-at", "2"])
    assert code == 0, out[-3000:]
    code, out = run_train([*base, "--run-dir", str(resumed), "--resume"])
    assert code == 0, out[-3000:]
    assert "resumed at step 2" in out
    code, out = run_train([*base, "--run-dir", str(straight)])
    assert code == 0, out[-3000:]
    return resumed, straight


def test_each_ep_rank_writes_the_shard_of_its_own_experts(runs: tuple[Path, Path]) -> None:
    step = runs[0] / "checkpoints" / "step-2"
    for ep_rank, experts in ((0, {"0", "1"}), (1, {"2", "3"})):
        shard = torch.load(step / shard_name("model", 0, 0, ep_rank), weights_only=True)
        held = {name.split(".")[4] for name in shard if ".experts." in name}
        assert held == experts
        assert (step / shard_name("optim", 0, 0, ep_rank)).is_file()


def test_a_resumed_ep_run_is_bit_identical_to_an_uninterrupted_one(
        runs: tuple[Path, Path]) -> None:
    resumed, straight = ([r["loss"] for r in read_records(d / "metrics.jsonl")] for d in runs)
    assert len(resumed) == STEPS and resumed == straight
    for ep_rank in (0, 1):
        name = shard_name("model", 0, 0, ep_rank)
        a, b = (torch.load(d / "checkpoints" / f"step-{STEPS}" / name, weights_only=True)
                for d in runs)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resuming_with_other_experts_or_ep_is_refused_showing_every_difference(
        runs: tuple[Path, Path]) -> None:
    code, out = run_train(["--ep", "1", "--moe-experts", "2", "--run-dir", str(runs[0]),
                           "--steps", str(STEPS + 1), "--resume"])
    assert code == 2, out[-3000:]
    assert out.count("checkpoint does not match this run") == 1
    assert "moe_experts: checkpoint 4, now 2" in out and "ep: checkpoint 2, now 1" in out


def test_the_metrics_hold_the_expert_load_and_the_run_draws_its_heat_map(
        runs: tuple[Path, Path]) -> None:
    for record in read_records(runs[1] / "metrics.jsonl"):
        load = record["moe"]["blocks.0.mlp"]
        assert sum(load["tokens"]) == 8 * 16 * 2 and load["dropped"] == 0
    png = runs[1] / PLOT_FILE
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_ep_shards_merge_into_the_single_device_model(runs: tuple[Path, Path]) -> None:
    step = runs[1] / "checkpoints" / f"step-{STEPS}"
    model, _ = load_serial(step)
    merged = model.state_dict()
    for ep_rank in (0, 1):
        shard = torch.load(step / shard_name("model", 0, 0, ep_rank), weights_only=True)
        assert all(torch.equal(merged[name], tensor) for name, tensor in shard.items())
    assert {n.split(".")[4] for n in merged if ".experts." in n} == {"0", "1", "2", "3"}
