"""``--memory-budget``: a cap on the bytes a rank holds for its model state, checked against
the expected bytes before the model is built and against the trainer's own accounting after
every step (`trainer.training.budget`).

    python -m trainer.train --model small --dp 4 --zero 3 --precision fp32 --memory-budget 0.5

The bytes are the largest rank's parameters, gradients and optimizer state, from Megatron's
bytes-per-parameter table (`trainer.parallel.zero.memory.expected_bytes`) priced on the rank's
share of the model as the planner counts it (`trainer.plan.estimate.model_state`, the model
built on the meta device), plus what ZeRO-2/3 hold only during a step (staged gradient
buckets; ZeRO-3's gathered units and their gradients). Activations are not included: they
depend on the batch and the recomputation, which the planner prices separately. The refusal
names the numbers and what would fit: a higher ZeRO stage (priced at the same layout), more
dp, tp or pp, or a higher budget.
"""

from __future__ import annotations

from trainer.config.options import TrainConfig
from trainer.errors import ConfigError, MemoryBudgetError
from trainer.parallel.zero.memory import MIB, MemoryTable
from trainer.plan.cluster import GIB
from trainer.plan.estimate import model_state


def budget_bytes(cfg: TrainConfig) -> int:
    """The cap in bytes (0: none)."""
    return round(cfg.optimizer.memory_budget * GIB)


def check_budget(cfg: TrainConfig, *, bf16: bool, report: bool) -> None:
    """Refuse a layout whose largest rank would hold more than the budget at the peak of a
    step; every rank computes the same from the config (``report``: the rank that prints)."""
    cap = budget_bytes(cfg)
    if not cap:
        return
    between, peak = model_state(cfg, bf16=bf16)
    if peak.total <= cap:
        return
    raise over_budget(cfg, f"would hold {_parts(between)} between steps and "
                      f"{peak.total / MIB:.2f} MiB at the peak of a step", bf16=bf16
                      ).everywhere(report=report)


def over_budget(cfg: TrainConfig, held: str, *, bf16: bool) -> MemoryBudgetError:
    """The one error of a rank over the budget: the numbers, then what would fit."""
    par, zero = cfg.parallel, cfg.optimizer.zero
    fixes = []
    if zero < 3:
        try:
            _, at3 = model_state(cfg.with_options(zero=3), bf16=bf16)
            fixes.append(f"--zero 3 (at this layout {at3.total / MIB:.2f} MiB at the peak)")
        except ConfigError as exc:  # zero 3 does not run with this layout yet
            fixes.append(f"--zero 3 where it runs ({exc.where})")
    fixes.append(f"raise --dp (now {par.dp}), --tp (now {par.tp}) or --pp (now {par.pp})")
    return MemoryBudgetError(
        "memory budget exceeded",
        f"--memory-budget {cfg.optimizer.memory_budget:g} GiB, the largest rank at "
        f"--zero {zero}, dp {par.dp} x tp {par.tp} x pp {par.pp}",
        f"it {held}, over the budget of {budget_bytes(cfg) / MIB:.2f} MiB "
        "(parameters, gradients and optimizer state; activations not counted)",
        f"Shard more of it: {'; or '.join(fixes)}; or raise --memory-budget")


def _parts(t: MemoryTable) -> str:
    return (f"parameters {t.params / MIB:.2f} MiB + gradients {t.grads / MIB:.2f} MiB + "
            f"optimizer {t.optimizer / MIB:.2f} MiB = {t.total / MIB:.2f} MiB")
