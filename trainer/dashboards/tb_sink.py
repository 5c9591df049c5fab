"""``--tensorboard``: the run's scalars as TensorBoard event files in ``<run-dir>/tensorboard``.

Written with ``tensorboard.summary.Writer``, the package's framework-free writer (numpy and
protobuf only, no TensorFlow; ``torch.utils.tensorboard`` writes the same event records through
the same package's ``EventFileWriter``). Scalars are flushed at every logged step, so a
TensorBoard pointed at the folder follows the run live and a killed run loses at most one
interval. A resumed run writes a new event file in the same folder; TensorBoard shows the
steps of both, as it does for torchtitan and Megatron-LM runs.
"""

from __future__ import annotations

from pathlib import Path

from trainer.errors import ConfigError

FOLDER = "tensorboard"


class TensorBoardSink:
    """Scalars of each logged step to an event file (rank 0 only)."""

    def __init__(self, run_dir: Path) -> None:
        try:
            from tensorboard.summary import Writer  # type: ignore[import-untyped]  # no stubs
        except ImportError as err:
            raise ConfigError("--tensorboard needs the tensorboard package", "--tensorboard",
                              str(err), "pip install tensorboard (dtrain installs it)") from None
        self.folder = run_dir / FOLDER
        self.folder.mkdir(parents=True, exist_ok=True)
        self._writer = Writer(str(self.folder))

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
