"""Validation of the click model: log-loss and AUC over the held-out rows of every rank.

Each rank scores its contiguous 1/G of the validation rows in chunks (the same number of
lookups on every rank, since each is collective; a rank out of rows looks up nothing), then the
scores are all-gathered so every rank computes the same log-loss and AUC. AUC is the
Mann-Whitney statistic with tied scores sharing their average rank. ``evals.jsonl`` keeps one
line per evaluation and ``auc.png`` plots it against the planted model's AUC, the ceiling.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional

from trainer.recsys.data import ClickLog
from trainer.recsys.model import DLRM
from trainer.training.metrics import draw, read_records, truncate_after

CHUNK = 8192
EVALS_FILE = "evals.jsonl"
AUC_PLOT = "auc.png"


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve of ``scores`` for binary ``labels`` (0.5 for one class only)."""
    values, inverse, counts = torch.unique(scores.double(), return_inverse=True,
                                           return_counts=True)
    below = torch.cumsum(counts, 0) - counts
    rank = (below + (counts + 1) / 2.0)[inverse]  # 1-based ranks, ties averaged
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return 0.5
    return float((rank[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def evaluate(model: DLRM, val: ClickLog) -> dict[str, float]:
    """{"val_loss", "val_auc"} of ``model`` on ``val`` (collective over the table's ranks)."""
    comm = model.table.comm
    per_rank = math.ceil(len(val) / comm.size)
    mine = val.rows(slice(comm.rank * per_rank, (comm.rank + 1) * per_rank))
    device = model.table.weight.device
    model.train(False)
    scores = []
    with torch.no_grad():
        for start in range(0, per_rank, CHUNK):
            part = mine.rows(slice(start, start + CHUNK))
            dense = part.dense.to(device, model.table.weight.dtype)
            scores.append(model.logits(dense, part.sparse.to(device)).float())
    model.train(True)
    local = torch.full((2, per_rank), math.nan, device=device)
    got = torch.cat(scores) if scores else torch.zeros(0, device=device)
    local[0, :len(got)], local[1, :len(got)] = got, mine.labels.to(device)
    every = torch.empty((comm.size, 2, per_rank), device=device)
    comm.all_gather(every.view(-1), local.view(-1))
    logits, labels = every[:, 0].reshape(-1), every[:, 1].reshape(-1)
    keep = ~labels.isnan()
    logits, labels = logits[keep].cpu(), labels[keep].cpu()
    loss = functional.binary_cross_entropy_with_logits(logits.double(), labels.double())
    return {"val_loss": float(loss), "val_auc": auc(logits, labels)}


def ceiling(val: ClickLog) -> float | None:
    """The planted model's own validation AUC (synthetic logs), the best any model can do."""
    return auc(val.truth, val.labels) if val.truth is not None else None


def truncate(run_dir: Path, start_step: int) -> str:
    """Drop the evaluations after ``start_step`` (a resumed run evaluates those steps again)
    and torn lines; the warning about those ("" if none, `trainer.training.metrics`)."""
    return truncate_after(run_dir / EVALS_FILE, start_step)


def record(run_dir: Path, step: int, result: dict[str, float]) -> None:
    """Append one evaluation to ``evals.jsonl``."""
    with open(run_dir / EVALS_FILE, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"step": step, **result}) + "\n")


def plot(run_dir: Path, planted: float | None, title: str) -> str:
    """``auc.png`` from ``evals.jsonl``; a failure is the returned warning (`metrics.draw`)."""
    rows: list[dict[str, Any]] = read_records(run_dir / EVALS_FILE)
    if not rows:
        return ""
    return draw(lambda png: _plot_auc(rows, planted, title, png), run_dir / AUC_PLOT)


def _plot_auc(rows: list[dict[str, Any]], planted: float | None, title: str, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["step"] for r in rows], [r["val_auc"] for r in rows], "o-", ms=3,
            label="validation AUC")
    if planted is not None:
        ax.axhline(planted, color="tab:green", ls="--", lw=1,
                   label=f"planted model (ceiling) {planted:.3f}")
    ax.axhline(0.5, color="tab:gray", ls=":", lw=1, label="chance")
    ax.set_xlabel("step")
    ax.set_ylabel("AUC")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(png)
    finally:
        plt.close(fig)
