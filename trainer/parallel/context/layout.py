"""Which tokens of a sequence each context-parallel rank holds: the zig-zag split (pure).

A sequence of ``seq_len`` tokens is cut into ``2 * cp`` equal chunks and rank ``r`` of the cp
group holds chunks ``r`` and ``2*cp - 1 - r``, in that order, as one local sequence of
``seq_len / cp`` tokens. Under a causal mask a chunk's work grows with its index (chunk ``i``
attends to ``i + 1`` chunks), so pairing one chunk from each end gives every rank the same work;
a contiguous split would give the last rank ``4*cp - 1`` blocks for the first rank's 3
(`trainer.parallel.context.plan` counts both). cp 2, 8 tokens::

    chunks    0: t0 t1 | 1: t2 t3 | 2: t4 t5 | 3: t6 t7
    rank 0    t0 t1 t6 t7        (chunks 0, 3)
    rank 1    t2 t3 t4 t5        (chunks 1, 2)

Everything that depends on where a token sits in the sequence (rotary angles, the causal mask,
later dropout and document masks) reads the rank's global `SequenceLayout.positions`, never the
local index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from trainer.comm.protocol import Communicator
from trainer.errors import ConfigError

Split = Literal["zigzag", "contiguous"]


class ContextParallelError(ConfigError):
    """A sequence, layout or attention call that context parallelism cannot run."""


@dataclass(frozen=True)
class SequenceLayout:
    """How one sequence is divided among the ranks of a cp group."""

    seq_len: int
    """Tokens of the whole sequence (every sample of a batch has the same)."""
    cp: int
    """Ranks of the context-parallel group."""
    split: Split = "zigzag"
    """``zigzag`` (the balanced one every run uses) or ``contiguous`` (rank r holds chunks 2r
    and 2r + 1), kept to measure what the zig-zag buys: the balance test and the benchmark."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ContextParallelError(
                    "invalid context-parallel layout", f"{name}={value!r}",
                    f"{name} must be a positive integer", f"Pass a {name} of 1 or more")
        if self.split not in ("zigzag", "contiguous"):
            raise ContextParallelError(
                "invalid context-parallel layout", f"split={self.split!r}",
                "the sequence splits are zigzag and contiguous", "Use one of them")
        chunks = 2 * self.cp
        if self.seq_len % chunks:
            below = self.seq_len - self.seq_len % chunks
            nearest = f"{below} or {below + chunks}" if below else str(chunks)
            raise ContextParallelError(
                "sequence does not split over the context-parallel ranks",
                f"seq_len {self.seq_len}, cp {self.cp}",
                f"{self.seq_len} tokens do not cut into 2 x cp = {chunks} equal chunks",
                f"Choose a seq_len that is a multiple of {chunks} (e.g. {nearest}), or a cp "
                f"for which 2 x cp divides {self.seq_len}")

    @property
    def chunk_len(self) -> int:
        return self.seq_len // (2 * self.cp)

    @property
    def local_len(self) -> int:
        """Tokens each rank holds: two chunks."""
        return 2 * self.chunk_len

    def chunks(self, rank: int) -> tuple[int, int]:
        """The indices of the two chunks ``rank`` holds, in local order."""
        self._check_rank(rank)
        if self.split == "zigzag":
            return rank, 2 * self.cp - 1 - rank
        return 2 * rank, 2 * rank + 1

    def ranges(self, rank: int) -> tuple[range, range]:
        """The global positions of ``rank``'s two chunks."""
        c, (a, b) = self.chunk_len, self.chunks(rank)
        return range(a * c, (a + 1) * c), range(b * c, (b + 1) * c)

    def positions(self, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Global positions (int64, ``local_len``) of ``rank``'s tokens, in local order: index
        rotary tables with them (``cos.index_select(0, positions)``)."""
        first, second = self.ranges(rank)
        return torch.cat([torch.arange(first.start, first.stop, device=device),
                          torch.arange(second.start, second.stop, device=device)])

    def split_tensor(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """``rank``'s tokens of a whole sequence ``x`` (``seq_len`` along ``dim``)."""
        if x.shape[dim] != self.seq_len:
            raise ContextParallelError(
                "cannot split a sequence over the context-parallel ranks",
                f"dim {dim} of a tensor of shape {tuple(x.shape)}",
                f"it has {x.shape[dim]} tokens where the layout has seq_len {self.seq_len}",
                "Split tensors of the layout's sequence length, along their sequence dim")
        first, second = self.ranges(rank)
        return torch.cat([x.narrow(dim, first.start, len(first)),
                          x.narrow(dim, second.start, len(second))], dim)

    def join(self, parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's part (``parts[r]`` is rank r's), the inverse
        of `split_tensor`."""
        if len(parts) != self.cp or any(p.shape[dim] != self.local_len for p in parts):
            raise ContextParallelError(
                "cannot join context-parallel parts", f"{len(parts)} parts along dim {dim}",
                f"the layout needs {self.cp} parts of {self.local_len} tokens each",
                "Pass one part per cp rank, in rank order")
        pieces: list[torch.Tensor | None] = [None] * (2 * self.cp)
        for rank, part in enumerate(parts):
            for half, index in zip(part.chunk(2, dim), self.chunks(rank), strict=True):
                pieces[index] = half
        return torch.cat([p for p in pieces if p is not None], dim)

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.cp:
            raise ContextParallelError(
                "rank outside the context-parallel group", f"rank {rank!r}",
                f"cp {self.cp} has ranks 0..{self.cp - 1}", "Pass the rank within the cp group")


@dataclass(frozen=True)
class LocalBatch:
    """One cp rank's share of a batch: its tokens and targets (B, local_len) and their global
    positions (local_len,), the same for every sample."""

    tokens: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor


def split_batch(tokens: torch.Tensor, targets: torch.Tensor, layout: SequenceLayout,
                rank: int) -> LocalBatch:
    """``rank``'s share of a batch of whole sequences (B, seq_len). Targets are cut at the
    same places as tokens: each token keeps its own next-token target, so the loss summed over
    the cp ranks is the unsplit loss."""
    return LocalBatch(layout.split_tensor(tokens, rank), layout.split_tensor(targets, rank),
                      layout.positions(rank, tokens.device))


def gather_sequence(x: torch.Tensor, comm: Communicator, layout: SequenceLayout,
                    dim: int = 1) -> torch.Tensor:
    """The whole sequence on every rank from each rank's part (collective over ``comm``, the
    cp group); for evaluation and checks, not the training step."""
    moved = x.detach().movedim(dim, 0).contiguous()
    out = moved.new_empty((comm.size * moved.shape[0], *moved.shape[1:]))
    comm.all_gather(out, moved)
    return layout.join([part.movedim(0, dim) for part in out.chunk(comm.size)], dim)
