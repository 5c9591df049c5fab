"""Checks of ``--sequence-parallel`` and ``--recompute``, run when the options are read.

Sequence parallelism splits the activations *between* the tensor-parallel regions along the
sequence over the TP ranks, so it needs tp > 1 and a sequence length that divides by tp.
"""

from __future__ import annotations

from trainer.errors import ConfigError

RECOMPUTE_MODES = ("none", "selective", "full")
"""none: keep every activation; selective: recompute the attention core (probabilities,
dropout, weighted sum) in backward; full: recompute each transformer block in backward."""


def check_activation_options(*, sequence_parallel: bool, recompute: str, tp: int,
                             seq_len: int) -> None:
    """Raise `ConfigError` naming the flag when the combination cannot run."""
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError("invalid option", f"--recompute {recompute}",
                          f"must be one of {', '.join(RECOMPUTE_MODES)}",
                          "Pass --recompute none, selective or full")
    if not sequence_parallel:
        return
    if tp < 2:
        raise ConfigError("sequence parallelism needs tensor parallelism",
                          f"--sequence-parallel --tp {tp}",
                          "it splits the activations between the tensor-parallel layers over "
                          "the tp ranks, and with tp 1 there is nothing to split over",
                          "Add --tp 2 (or more), or drop --sequence-parallel")
    if seq_len % tp:
        raise ConfigError("sequence does not split over the tensor-parallel group",
                          f"--sequence-parallel --tp {tp} --seq-len {seq_len}",
                          f"seq_len {seq_len} is not divisible by tp {tp}",
                          f"Choose a --seq-len that is a multiple of {tp}")
