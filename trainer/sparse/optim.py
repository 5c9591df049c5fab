"""Row-wise sparse optimizers of a `ShardedEmbedding`: only the rows seen in the step change.

The table's gradient arrives coalesced (one row per key, duplicates summed, `ShardedEmbedding.
accumulate`), so each update is a gather, a few row-wise operations and a scatter of the touched
rows. The rules are torch's own for sparse gradients, so a serial ``nn.EmbeddingBag(sparse=True)``
with the matching torch optimizer is the reference:

- ``sgd``: w -= lr g (``torch.optim.SGD``);
- ``adagrad``: s += g²; w -= lr g / (√s + eps) (``torch.optim.Adagrad``, eps 1e-10);
- ``adam``: lazy Adam (``torch.optim.SparseAdam``): m and v of a row move only when the row is
  seen; the bias correction uses the global step count.

State (accumulators, moments, step) is per shard and goes into the checkpoint with the rows.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trainer.sparse.hashing import SparseError
from trainer.sparse.table import ShardedEmbedding

KINDS = ("sgd", "adagrad", "adam")


class SparseOptimizer:
    """Updates the rows of ``tables`` that got gradients, with one rule and learning rate."""

    def __init__(self, tables: list[ShardedEmbedding], *, kind: str, lr: float,
                 eps: float | None = None, betas: tuple[float, float] = (0.9, 0.999)) -> None:
        if kind not in KINDS:
            raise SparseError("unknown sparse optimizer", "embedding optimizer", repr(kind),
                              f"Use one of {', '.join(KINDS)}")
        self.tables, self.kind, self.lr, self.betas = tables, kind, lr, betas
        self.eps = eps if eps is not None else (1e-10 if kind == "adagrad" else 1e-8)
        self.step_count = 0
        slots = {"sgd": (), "adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq")}[kind]
        self.state = [{s: torch.zeros_like(t.weight) for s in slots} for t in tables]

    def zero_grad(self) -> None:
        for table in self.tables:
            table.zero_grad()

    def step(self) -> None:
        self.step_count += 1
        for table, state in zip(self.tables, self.state, strict=True):
            if table.grad_rows is None or len(table.grad_rows) == 0:
                continue
            rows, g = table.grad_rows, table.grad_values
            getattr(self, f"_{self.kind}")(table.weight, rows, g, state)

    def _sgd(self, w: torch.Tensor, rows: torch.Tensor, g: torch.Tensor,
             state: dict[str, torch.Tensor]) -> None:
        w[rows] -= self.lr * g

    def _adagrad(self, w: torch.Tensor, rows: torch.Tensor, g: torch.Tensor,
                 state: dict[str, torch.Tensor]) -> None:
        total = state["sum"][rows] + g * g
        state["sum"][rows] = total
        w[rows] -= self.lr * (g / (total.sqrt() + self.eps))

    def _adam(self, w: torch.Tensor, rows: torch.Tensor, g: torch.Tensor,
              state: dict[str, torch.Tensor]) -> None:
        beta1, beta2 = self.betas
        m_old, v_old = state["exp_avg"][rows], state["exp_avg_sq"][rows]
        m = m_old + (g - m_old) * (1 - beta1)
        v = v_old + (g * g - v_old) * (1 - beta2)
        state["exp_avg"][rows], state["exp_avg_sq"][rows] = m, v
        step_size = self.lr * math.sqrt(1 - beta2**self.step_count) / (1 - beta1**self.step_count)
        w[rows] += -step_size * (m / (v.sqrt() + self.eps))

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "step": self.step_count, "state": self.state}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if saved["kind"] != self.kind:
            raise SparseError("checkpoint of another embedding optimizer", "resume",
                              f"saved {saved['kind']}, running {self.kind}",
                              "Resume with the optimizer the run was started with")
        self.step_count = saved["step"]
        for mine, theirs in zip(self.state, saved["state"], strict=True):
            for name, tensor in mine.items():
                tensor.copy_(theirs[name])
