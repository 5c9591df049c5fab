"""What each ZeRO stage runs with, refused when the options are read, before any rank builds
anything (pure: no torch, no communicator)."""

from __future__ import annotations

from typing import Protocol

from trainer.errors import ConfigError


class Layout(Protocol):
    """The parallel section's fields the checks read (`trainer.config.sections`)."""

    @property
    def pp(self) -> int: ...
    @property
    def chunks(self) -> int: ...
    @property
    def schedule(self) -> str: ...
    @property
    def tp(self) -> int: ...
    @property
    def sequence_parallel(self) -> bool: ...
    @property
    def recompute(self) -> str: ...
    @property
    def zero_shard_size(self) -> int: ...


def check_zero(zero: int, layout: Layout, *, precision: str = "fp32",
               compiled: bool = False) -> None:
    """Refuse what ``--zero`` does not run with yet.

    ZeRO-3 (`trainer.parallel.zero.units`) runs with tensor, sequence and pipeline
    parallelism (every schedule: its units reduce when complete, not in rounds), recomputation,
    bf16 and accumulation; not with compiled blocks, whose compiled graphs would bypass the
    module hooks that gather the units. ZeRO-2 reduces its buckets in rounds that need every
    backward to cover the whole model (`trainer.parallel.zero.grad_shards`); under the
    interleaved schedule a backward covers one model chunk, so a bucket that spans two chunks
    would be reduced from part of its gradients."""
    if zero == 2 and layout.pp > 1 and layout.chunks > 1:
        raise ConfigError(
            "unsupported combination",
            f"--zero 2 with --schedule {layout.schedule} (v {layout.chunks})",
            "ZeRO-2 reduce-scatters each bucket once per backward, and a backward of the "
            "interleaved schedule covers only one of a rank's model chunks",
            "Use --schedule 1f1b or gpipe with --zero 2, or --zero 1 with the interleaved "
            "schedule")
    if not zero and layout.zero_shard_size:
        raise ConfigError(
            "hybrid sharding needs ZeRO", f"--zero-shard-size {layout.zero_shard_size} with "
            "--zero 0", "the shard groups shard the optimizer state (and at --zero 2 and 3 "
            "the gradients and parameters), which --zero 0 keeps whole on every rank",
            "Add --zero 1, 2 or 3, or drop --zero-shard-size")
    if zero != 3:
        return
    if compiled:
        raise ConfigError(
            "unsupported combination", "--zero 3 with --compile",
            "compiled blocks bypass the module hooks that gather each block's parameters "
            "before it runs", "Drop --compile, or use --zero 2")
