"""``--wandb offline|online``: the run's scalars and config as a Weights & Biases run.

Optional: ``wandb`` is not a dependency (``pip install 'dtrain[wandb]'``); asking for it without
the package is one clear error before training starts. ``offline`` writes the run under
``<run-dir>/wandb`` for a later ``wandb sync`` (compute nodes often have no internet);
``online`` needs the usual ``WANDB_API_KEY`` in the environment (forwarded by the launcher,
never on a command line). The W&B run id is derived from the run folder, so a resumed run
continues the same W&B run (``resume="allow"``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from trainer.errors import ConfigError

MODES = ("offline", "online")


class WandbSink:
    """Scalars of each logged step to a W&B run (rank 0 only)."""

    def __init__(self, run_dir: Path, mode: str, config: dict[str, Any],
                 project: str = "dtrain") -> None:
        try:
            import wandb  # type: ignore[import-not-found,unused-ignore]  # optional extra
        except ImportError:
            raise ConfigError("--wandb needs the wandb package", f"--wandb {mode}",
                              "it is not installed in this environment",
                              "pip install 'dtrain[wandb]', or drop --wandb") from None
        run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
        self._run = wandb.init(project=project, dir=str(run_dir), mode=mode, config=config,
                               id=run_id, name=run_dir.name, resume="allow")

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()
