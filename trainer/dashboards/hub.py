"""The run's dashboards: every sink the options ask for, fed each logged step (rank 0 only)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from trainer.dashboards.names import scalars
from trainer.training.metrics import StepRecord


class Sink(Protocol):
    """Where the scalars of a step go."""

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class Dashboards:
    """The sinks of one run; each `record` computes the step's scalars once for all of them."""

    def __init__(self, sinks: list[Sink], *, flops_per_token: float, devices: int,
                 peak_tflops: float | None, skipped: Callable[[], int]) -> None:
        self.sinks, self.devices, self.peak = sinks, devices, peak_tflops
        self.flops_per_token, self.skipped = flops_per_token, skipped

    def record(self, rec: StepRecord) -> None:
        if not self.sinks:
            return
        values = scalars({**asdict(rec), "tokens_per_s": rec.tokens_per_s},
                         flops_per_token=self.flops_per_token, devices=self.devices,
                         peak_tflops=self.peak, skipped_steps=self.skipped())
        for sink in self.sinks:
            sink.log(rec.step, values)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_sinks(run_dir: Path, *, tensorboard: bool, wandb: str, config: dict[str, Any],
               enabled: bool) -> list[Sink]:
    """The sinks asked for (none where ``enabled`` is false: only one rank writes)."""
    sinks: list[Sink] = []
    if enabled and tensorboard:
        from trainer.dashboards.tb_sink import TensorBoardSink  # imports tensorboard

        sinks.append(TensorBoardSink(run_dir))
    if enabled and wandb:
        from trainer.dashboards.wandb_sink import WandbSink  # imports wandb

        sinks.append(WandbSink(run_dir, wandb, config))
    return sinks
