"""Refuse an expert-parallel layout or a combination MoE models cannot run, before any rank
starts work (`trainer.config.options.TrainConfig` calls `check_moe` with its sections; the MoE
fields themselves are checked by `trainer.model.config.MoEConfig`).
"""

from __future__ import annotations

from typing import Protocol

from trainer.errors import ConfigError
from trainer.model.config import MoEConfig


class Layout(Protocol):
    """What the checks read of the parallel section (`trainer.config.sections`)."""

    @property
    def ep(self) -> int: ...
    @property
    def sequence_parallel(self) -> bool: ...
    @property
    def recompute(self) -> str: ...
    @property
    def zero_shard_size(self) -> int: ...


def check_moe(moe: MoEConfig, layout: Layout, *, zero: int) -> None:
    """Both checks below, on the run's sections."""
    check_layout(experts=moe.experts, ep=layout.ep)
    check_combinations(experts=moe.experts, zero=zero,
                       sequence_parallel=layout.sequence_parallel, recompute=layout.recompute,
                       shard_size=layout.zero_shard_size)


def check_layout(*, experts: int, ep: int) -> None:
    """Refuse an expert-parallel size that does not split the experts (whether it splits the
    DP ranks is the parallel section's check)."""
    where = f"--ep {ep}"
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


def check_combinations(*, experts: int, zero: int, sequence_parallel: bool,
                       recompute: str, shard_size: int = 0) -> None:
    """Refuse what MoE models do not run with yet, before any rank starts: ZeRO-1 and 2 (their
    one sharded gradient buffer spans one DP group, and the experts' gradients reduce over
    their own expert-DP group; ZeRO-3 gives each group its own units,
    `trainer.parallel.zero.split`), hybrid sharding, and the activation techniques (MoE
    models are built whole, not per rank)."""
    if not experts:
        return
    refused = [flag for flag, on in ((f"--zero {zero}", zero in (1, 2)),
                                     (f"--zero-shard-size {shard_size}", shard_size),
                                     ("--sequence-parallel", sequence_parallel),
                                     (f"--recompute {recompute}", recompute != "none")) if on]
    if refused:
        raise ConfigError(
            "unsupported combination", f"--moe-experts {experts} with {', '.join(refused)}",
            "mixture-of-experts models run with --zero 0 or 3 only, and not with hybrid "
            "sharding, sequence parallelism or recomputation yet",
            f"Drop {', '.join(refused)} (--zero 3 shards the experts over their expert-data-"
            "parallel group), or train a dense model (--moe-experts 0)")
