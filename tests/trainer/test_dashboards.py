"""The TensorBoard sink writes event files that TensorBoard's own reader reads back."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from trainer.dashboards.names import NAMES, scalars
from trainer.dashboards.tb_sink import TensorBoardSink
from trainer.dashboards.wandb_sink import WandbSink
from trainer.errors import ConfigError

RECORD = {"step": 4, "loss": 3.5, "lr": 1e-3, "grad_norm": 0.75, "tokens": 4096,
          "step_s": 0.5, "tokens_per_s": 8192.0, "val_loss": 3.25, "peak_mem_bytes": 2**30}


def read_back(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the event files in ``folder``, as TensorBoard loads them."""
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in
                  acc.Tensors(tag)] for tag in acc.Tags()["tensors"]}


def test_logged_scalars_are_read_back_by_tensorboards_event_accumulator(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path)
    first = scalars(RECORD, flops_per_token=1e6, devices=2, peak_tflops=10.0, skipped_steps=0)
    sink.log(4, first)
    sink.log(8, scalars({**RECORD, "loss": 3.0, "val_loss": None}, flops_per_token=1e6,
                        devices=2, peak_tflops=10.0, skipped_steps=1))
    sink.close()
    series = read_back(tmp_path / "tensorboard")
    assert series[NAMES["loss"]] == [(4, 3.5), (8, 3.0)]
    assert series[NAMES["val_loss"]] == [(4, 3.25)]  # only the step that evaluated
    assert series[NAMES["skipped_steps"]] == [(4, 0.0), (8, 1.0)]
    assert series[NAMES["tflops"]][0] == (4, pytest.approx(8192 * 1e6 / 1e12 / 2))
    assert series[NAMES["mfu_pct"]][0] == (4, pytest.approx(100 * 8192 * 1e6 / 1e12 / 2 / 10))
    assert series[NAMES["memory_gib"]][0] == (4, 1.0)
    assert set(series) == set(NAMES.values())


def test_wandb_without_the_package_is_one_clear_error(tmp_path: Path) -> None:
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"--wandb needs the wandb package \[--wandb "
                                              r"offline\].*pip install 'dtrain\[wandb\]'"):
            WandbSink(tmp_path, "offline", {})
    else:
        sink = WandbSink(tmp_path, "offline", {"model": "llama-tiny"})
        sink.log(1, {"lr": 1.0})
        sink.close()
        assert list((tmp_path / "wandb").glob("offline-run-*"))
