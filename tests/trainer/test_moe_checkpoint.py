"""An ep 2 run through ``python -m trainer.train``: each EP rank writes its experts, bit-exact
resume, refusal of another E, and the expert load in the metrics file and its heat map.

Two ranks (dp 2 = ep 2): each holds 2 of the 4 experts of the MoE layer, so each writes their
slices (and a share of the dense ones). The same run split at step 2 and resumed must give the
very floats of an uninterrupted run; another number of experts is another model, refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.mpi_runs import run_ranks
from tests.support.saved import same_states, saved_state
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


def test_each_ep_rank_writes_the_slices_of_its_own_experts(runs: tuple[Path, Path]) -> None:
    index = json.loads((runs[0] / "checkpoints" / "step-2" / "index.json").read_text())
    for ep_rank, experts in ((0, {"0", "1"}), (1, {"2", "3"})):
        entries = index["files"][f"rank-{ep_rank:05d}.safetensors"]
        assert {e["name"].split(".")[4] for e in entries if ".experts." in e["name"]} == experts
        assert {e["kind"] for e in entries} == {"param", "exp_avg", "exp_avg_sq"}


def test_a_resumed_ep_run_is_bit_identical_to_an_uninterrupted_one(
        runs: tuple[Path, Path]) -> None:
    resumed, straight = ([r["loss"] for r in read_records(d / "metrics.jsonl")] for d in runs)
    assert len(resumed) == STEPS and resumed == straight
    assert same_states(*(saved_state(d / "checkpoints" / f"step-{STEPS}") for d in runs)) == []


def test_resuming_with_another_number_of_experts_is_refused_as_another_model(
        runs: tuple[Path, Path]) -> None:
    code, out = run_train(["--ep", "1", "--moe-experts", "2", "--run-dir", str(runs[0]),
                           "--steps", str(STEPS + 1), "--resume"])
    assert code == 2, out[-3000:]
    assert out.count("checkpoint does not match this run") == 1
    assert "moe_experts: checkpoint 4, now 2" in out and "ep:" not in out


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
    merged, saved = model.state_dict(), saved_state(step)["param"]
    assert all(torch.equal(merged[name], tensor) for name, tensor in saved.items())
    assert {n.split(".")[4] for n in merged if ".experts." in n} == {"0", "1", "2", "3"}
