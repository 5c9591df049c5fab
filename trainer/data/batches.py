"""Deterministic DP-sharded batches of the byte corpus (`trainer.data.corpus`).

Sampling. The global batch of step ``s`` is ``global_batch`` random windows whose start offsets
come from a generator seeded with (seed, s) alone (validation batch ``k``: (seed, k) on a stream
of its own, the same windows at every evaluation). DP rank r takes the r-th contiguous slice of
``global_batch / dp`` windows and cuts it into microbatches. Consequences: the data position of
a run is just its step (resume needs no loader state), DP ranks never overlap, and any dp size
sees the same global batch, so a run can be resumed with a different dp.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.data.corpus import Corpus, DataError

#: The random stream of validation windows (0 is the training data's).
VAL_STREAM = 3

Microbatch = tuple[torch.Tensor, ...]
"""``(inputs, targets)`` (B, T) each, or ``(inputs, targets, documents)`` under
``--document-mask``: the window's document ids (`trainer.model.documents`), the whole window's
even where ``keep`` cuts inputs and targets, so that every rank masks by global ids. The model
takes them as ``model.loss(*microbatch)``."""

Keep = Callable[[torch.Tensor], torch.Tensor]
"""The tokens of a batch of whole windows (B, seq_len) this rank trains on: under context
parallelism its zig-zag chunks (`trainer.parallel.context.SequenceLayout.split_tensor`), tokens
and targets cut at the same places; None: all of them."""


def kept(pair: tuple[torch.Tensor, torch.Tensor], keep: Keep | None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` cut to what ``keep`` keeps."""
    return pair if keep is None else (keep(pair[0]), keep(pair[1]))


def check_splits(corpus: Corpus, seq_len: int, *, validation: bool) -> None:
    """Refuse a training split (and, when evaluating, a validation split) too small for a
    window, before any step runs."""
    window_starts(0, 0, global_batch=1, seq_len=seq_len, corpus_len=len(corpus.train))
    if validation:
        window_starts(0, 0, global_batch=1, seq_len=seq_len, corpus_len=len(corpus.val),
                      split="validation")


def _mix(*values: int) -> int:
    """Combine integers into one 63-bit seed (splitmix64 steps), so (seed, step) streams
    for neighbouring steps are unrelated."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 29
    return x & 0x7FFFFFFFFFFFFFFF


def step_seed(seed: int, step: int, *streams: int) -> int:
    """The seed of step ``step`` for an independent random stream (0 = data, others free)."""
    return _mix(seed, step, *streams)


def window_starts(seed: int, step: int, *, global_batch: int, seq_len: int,
                  corpus_len: int, stream: int = 0, split: str = "training") -> torch.Tensor:
    """Start offsets (global_batch,) of the windows of step ``step``; a function of its inputs."""
    high = corpus_len - seq_len - 1
    if high < 1:
        raise DataError(f"{split} data too small", f"{corpus_len} bytes",
                        f"a window needs seq_len+1 = {seq_len + 1} bytes and a choice of start "
                        "offsets", "Use a bigger --data or --data-cap-mb, or a smaller seq_len"
                        + (" or a larger --val-fraction" if split == "validation" else ""))
    gen = torch.Generator(device="cpu").manual_seed(step_seed(seed, step, stream))
    return torch.randint(0, high, (global_batch,), generator=gen)


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch is divided: ``global_batch = dp * microbatches * micro_batch_size``."""

    global_batch: int
    dp: int
    microbatches: int

    def __post_init__(self) -> None:
        if self.global_batch % (self.dp * self.microbatches):
            raise ValueError(
                f"global batch {self.global_batch} is not divisible by dp*microbatches "
                f"({self.dp}*{self.microbatches}={self.dp * self.microbatches})")

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch // (self.dp * self.microbatches)

    def local_slice(self, dp_rank: int) -> slice:
        per_rank = self.global_batch // self.dp
        return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


class ShardedBatches:
    """Microbatches of one DP rank for any step, computed on demand (no iterator state).
    ``validation`` draws from the held-out split (batch k in place of step k); ``keep``: the
    part of each window this rank trains on (`Keep`)."""

    def __init__(self, corpus: Corpus, *, seq_len: int, plan: BatchPlan, seed: int,
                 dp_rank: int, device: torch.device | str = "cpu",
                 validation: bool = False, keep: Keep | None = None) -> None:
        self.keep = keep
        self.tokens = corpus.val if validation else corpus.train
        self.seq_len, self.plan = seq_len, plan
        self.seed, self.dp_rank, self.device = seed, dp_rank, torch.device(device)
        self._stream = VAL_STREAM if validation else 0
        self._split = "validation" if validation else "training"
        self._starts(0, 1)  # refuse a split too small for one window now, not at step 1
        self._offsets = torch.arange(seq_len + 1)

    def _starts(self, step: int, count: int) -> torch.Tensor:
        return window_starts(self.seed, step, global_batch=count, seq_len=self.seq_len,
                             corpus_len=len(self.tokens), stream=self._stream, split=self._split)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole batch of ``step`` (inputs, targets), each (global_batch, seq_len)."""
        return self._windows(self._starts(step, self.plan.global_batch))

    def microbatches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's microbatches of ``step``, in order, each (micro_batch_size, seq_len),
        or the tokens of them it keeps."""
        local = self._starts(step, self.plan.global_batch)[self.plan.local_slice(self.dp_rank)]
        return [kept(self._windows(part), self.keep)
                for part in local.split(self.plan.micro_batch_size)]

    def _windows(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.tokens[starts[:, None] + self._offsets].long()
        x, y = rows[:, :-1], rows[:, 1:]
        if self.device.type != "cpu":
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return x, y
