"""Refuse an MoE model or expert-parallel layout that cannot run, before any rank starts work.

`check_model` runs inside `GPTConfig.__post_init__` (a ValueError there becomes the trainer's
ConfigError naming the source); `check_layout` runs on the training options once dp is known.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.errors import ConfigError
from trainer.moe.router import SCORE_FUNCTIONS

if TYPE_CHECKING:
    from trainer.model.config import GPTConfig


def check_model(cfg: GPTConfig) -> None:
    """Raise ValueError naming the first impossible MoE field of ``cfg``."""
    if cfg.moe_experts < 0:
        raise ValueError(f"moe_experts must be >= 0 (0 = dense), got {cfg.moe_experts}")
    if not cfg.moe_experts:
        return
    if not 1 <= cfg.moe_topk <= cfg.moe_experts:
        raise ValueError(f"moe_topk must be between 1 and moe_experts ({cfg.moe_experts}), "
                         f"got {cfg.moe_topk}")
    if cfg.moe_every < 1:
        raise ValueError(f"moe_every must be >= 1, got {cfg.moe_every}")
    if cfg.moe_router not in SCORE_FUNCTIONS:
        raise ValueError(f"moe_router must be one of {', '.join(SCORE_FUNCTIONS)}, "
                         f"got {cfg.moe_router!r}")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_capacity_factor"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(cfg, name)}")


def check_layout(*, experts: int, ep: int, dp: int | None) -> None:
    """Refuse an expert-parallel size that does not split the experts or the DP ranks (``dp``
    None: not known yet, only the experts are checked)."""
    where = f"--ep {ep}"
    if ep < 1:
        raise ConfigError("invalid option", where, "must be >= 1", "Pass --ep 1 or more")
    if ep == 1:
        return
    if not experts:
        raise ConfigError("expert parallelism without experts", where,
                          "the model has no MoE layers (--moe-experts 0)",
                          "Pass --moe-experts E (a multiple of ep), or drop --ep")
    if experts % ep:
        raise ConfigError("experts do not split over the expert-parallel group",
                          f"{where} --moe-experts {experts}",
                          f"{experts} experts is not a multiple of ep = {ep}",
                          f"Choose an ep that divides {experts}, or a multiple of {ep} experts")
    if dp is not None and dp % ep:
        raise ConfigError("expert parallelism does not fit the data-parallel ranks",
                          f"{where}, dp = {dp}",
                          f"the EP groups are carved from the {dp} DP rank(s), and ep = {ep} "
                          "does not divide them",
                          f"Start a multiple of {ep} DP ranks, or choose an ep that divides {dp}")


def check_combinations(*, experts: int, zero: int, sequence_parallel: bool,
                       recompute: str) -> None:
    """Refuse what MoE models do not run with yet, before any rank starts: ZeRO-1 (expert
    gradients reduce over their own expert-DP group, which the sharded optimizer does not know)
    and the activation techniques (MoE models are built whole, not per rank)."""
    if not experts:
        return
    refused = [flag for flag, on in (("--zero 1", zero), ("--sequence-parallel",
                                                          sequence_parallel),
                                     (f"--recompute {recompute}", recompute != "none")) if on]
    if refused:
        raise ConfigError(
            "unsupported combination", f"--moe-experts {experts} with {', '.join(refused)}",
            "mixture-of-experts models do not run with ZeRO-1, sequence parallelism or "
            "recomputation yet",
            f"Drop {', '.join(refused)}, or train a dense model (--moe-experts 0)")
