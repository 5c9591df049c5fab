"""Checks of ``--sequence-parallel`` and ``--recompute``, run when the options are read
(`trainer.config.sections.ParallelSection` declares both and checks their choices).

Sequence parallelism splits the activations *between* the tensor-parallel regions along the
sequence over the TP ranks, so it needs tp > 1 and a sequence length that divides by tp.
"""

from __future__ import annotations

from trainer.errors import ConfigError

RECOMPUTE_MODES = ("none", "selective", "full")
"""none: keep every activation; selective: recompute the attention core (probabilities,
dropout, weighted sum) in backward; full: recompute each transformer block in backward."""


def check_sequence_split(*, sequence_parallel: bool, tp: int, seq_len: int) -> None:
    """Refuse sequence parallelism over a sequence that does not split into tp blocks (that it
    needs tp > 1 is the parallel section's own check)."""
    if sequence_parallel and seq_len % tp:
        raise ConfigError("sequence does not split over the tensor-parallel group",
                          f"--sequence-parallel --tp {tp} --seq-len {seq_len}",
                          f"seq_len {seq_len} is not divisible by tp {tp}",
                          f"Choose a --seq-len that is a multiple of {tp}")
