"""Model FLOPs per token, the peak table and the MFU the training log shows (`trainer.model.flops`).

The FLOPs are checked against the model itself (its parameter count) and against PaLM's
formula written out by hand for GPT-2 small's shape; the log line comes from a real
single-process training run on this CPU.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support.mpi_runs import forked_python
from trainer.config.options import parse_args
from trainer.errors import ConfigError
from trainer.model.config import PRESETS, GPTConfig
from trainer.model.flops import flops_per_token, matmul_params, mfu, peak_tflops
from trainer.model.gpt import GPT
from trainer.training.metrics import read_records

VARIANTS = [PRESETS["tiny"], GPTConfig(tied=False, bias=True, norm="rmsnorm"),
            GPTConfig(tied=False, mlp_ratio=2), GPTConfig(bias=True, n_layer=3)]


@pytest.mark.parametrize("cfg", VARIANTS, ids=["tiny", "untied-bias-rms", "untied", "bias"])
def test_n_is_the_models_parameters_without_an_untied_embedding_table(cfg: GPTConfig) -> None:
    table = 0 if cfg.tied else cfg.vocab_size * cfg.d_model
    assert matmul_params(cfg) == GPT(cfg).num_params() - table


def test_flops_per_token_of_gpt2_small_shape_are_6n_plus_the_attention_term() -> None:
    cfg = PRESETS["125m"]  # 12 layers, d 768, context 1024, byte vocabulary, tied
    d = 768
    n = 12 * (4 * d + 12 * d * d) + 2 * d + 256 * d
    assert flops_per_token(cfg) == 6 * n + 12 * 12 * d * 1024


def test_mfu_divides_model_flops_per_second_by_the_peak_of_every_device() -> None:
    cfg = PRESETS["small"]
    rate = 2.0e5
    want = rate * flops_per_token(cfg) / (8 * 989e12)
    assert mfu(rate, cfg, 989.0, 8) == pytest.approx(want, rel=1e-12)


def test_a_cpu_has_no_peak_unless_one_is_given() -> None:
    assert peak_tflops(torch.device("cpu")) is None
    assert peak_tflops(torch.device("cpu"), 1.5) == 1.5


def test_a_negative_peak_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"\[--peak-tflops -1.0\]: must be >= 0"):
        parse_args(["--peak-tflops", "-1"])


def _train(run_dir: Path, *extra: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*forked_python(), "-m", "trainer.train", "--model", "tiny", "--steps", "4",
         "--global-batch", "2", "--log-every", "2", "--eval-every", "0", "--data-cap-mb", "0.25",
         "--run-dir", str(run_dir), *extra],
        capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr + done.stdout


def test_a_cpu_run_logs_mfu_per_interval_only_with_peak_tflops(tmp_path: Path) -> None:
    without = _train(tmp_path / "plain")
    assert "MFU" not in without
    out = _train(tmp_path / "peak", "--peak-tflops", "0.5")
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2
    records = read_records(tmp_path / "peak" / "metrics.jsonl")
    for line, last in zip(lines, (2, 4), strict=True):
        window = [r for r in records if last - 2 < r["step"] <= last]
        rate = sum(r["tokens"] for r in window) / sum(r["step_s"] for r in window)
        shown = float(line.split("MFU ")[1].split("%")[0])
        want = 100 * mfu(rate, PRESETS["tiny"], 0.5, 1)
        assert shown == pytest.approx(want, abs=0.005 + 1e-9), line  # printed with 2 decimals
