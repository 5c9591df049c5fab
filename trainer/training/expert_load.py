"""Expert load: per layer and step in ``metrics.jsonl``, and a heat map at the end of a run.

Each MoE layer counts, over the training forwards of a step on its rank, the assignments each
expert was routed (before dropping), the dropped assignments and the auxiliary loss. `step_load`
sums them over the DP group (the whole global batch) and returns, per layer name::

    {"tokens": [per expert], "dropped": n, "aux_loss": mean over the step's forwards}

With a pipeline, rank 0 (the first stage) reports the MoE layers of its own stage.
`plot_expert_load` draws ``expert_load.png`` from the metrics file: one panel per layer, the
share of the step's assignments each expert received, experts down, steps across.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.comm.protocol import Communicator, ReduceOp
from trainer.parallel.expert.layer import moe_layers
from trainer.training.metrics import METRICS_FILE, draw, read_records

PLOT_FILE = "expert_load.png"


def step_load(model: nn.Module, dp: Communicator) -> dict[str, Any] | None:
    """This step's load of every MoE layer of ``model``, summed over ``dp`` (collective);
    None for a dense model."""
    layers = moe_layers(model)
    if not layers:
        return None
    loads = torch.stack([layer.take_load() for _, layer in layers])
    dp.all_reduce(loads, ReduceOp.SUM)
    out = {}
    for (name, _), row in zip(layers, loads.cpu().tolist(), strict=True):
        *tokens, dropped, aux, forwards = row
        out[name] = {"tokens": [int(t) for t in tokens], "dropped": int(dropped),
                     "aux_loss": aux / forwards if forwards else 0.0}
    return out


def plot_expert_load(steps: list[dict[str, Any]], png: Path, *, title: str = "") -> None:
    """Write the heat map of the expert load of ``steps`` (records that hold one)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = list(steps[0]["moe"])
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 1.2 + 1.6 * len(names)), dpi=100,
                             squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        share = torch.tensor([r["moe"][name]["tokens"] for r in steps], dtype=torch.float64)
        share = (share / share.sum(1, keepdim=True).clamp(min=1)).t()
        image = ax.imshow(share.numpy(), aspect="auto", interpolation="nearest", cmap="viridis",
                          extent=(steps[0]["step"] - 0.5, steps[-1]["step"] + 0.5,
                                  share.shape[0] - 0.5, -0.5))
        ax.set_ylabel(f"{name}\nexpert")
        fig.colorbar(image, ax=ax, label="share of tokens")
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title or "expert load")
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def write_load_plot(run_dir: Path, *, title: str = "") -> str:
    """``expert_load.png`` in ``run_dir`` from its metrics file (nothing for a dense model).
    Drawn after the run has saved, so a failure is only the returned warning (`draw`)."""
    path = run_dir / METRICS_FILE
    steps = [r for r in read_records(path) if r.get("moe")] if path.is_file() else []
    if not steps:
        return ""
    return draw(lambda tmp: plot_expert_load(steps, tmp, title=title), run_dir / PLOT_FILE)
