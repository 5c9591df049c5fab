"""The serial initialisation's random numbers, drawn in bounded pieces and cut to one shard.

`GPT.init_weights` fills each weight with ``torch.randn(shape, generator=gen) * std``, one
weight after the other from one generator. To give a rank its shard of that value without ever
holding the whole weight, `normal_pieces` draws the same numbers in pieces of at most
``PIECE`` elements (plus a 31-element tail), and `shard_of_stream` keeps the rank's part. The
padded rows of the vocabulary weights are never drawn (`trainer.model.gpt.drawn_rows`): the
stream of such a weight is its real rows' numbers `followed_by_zeros`, cut like any other.

Why the pieces are equal to one big draw (torch's CPU ``normal_fill``, float and double, with
or without AVX2, for a contiguous tensor of n >= 16 elements): it first draws n uniforms, then
turns every aligned block of 16 into normals on its own (Box-Muller within the block); when
n % 16 = r != 0 it then draws 16 *fresh* uniforms and overwrites the last 16 values with their
normals. So drawing the first 16·⌊n/16⌋ values in pieces that are multiples of 16 gives the same
values, then r uniforms must be drawn and dropped, then 16 normals replace the last 16 values.
Below 16 elements torch uses another path; those weights are drawn whole, like the serial init.
This rests on torch's kernel: ``tests/trainer/test_construction.py`` compares with ``torch.randn``
for
every size class, so a torch that draws differently fails there, not silently.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from trainer.parallel.tensor.sharding import ShardSpec, shard_tensor

BLOCK = 16
PIECE = 1 << 16
"""Elements per drawn piece (a multiple of BLOCK): the most a rank holds beyond its shard."""


def normal_pieces(n: int, gen: torch.Generator, dtype: torch.dtype,
                  piece: int = PIECE) -> Iterator[torch.Tensor]:
    """Consecutive pieces whose concatenation equals ``torch.randn(n, generator=gen,
    dtype=dtype)`` and which leave ``gen`` in the same state."""
    if n < BLOCK:
        yield torch.randn(n, generator=gen, dtype=dtype)
        return
    whole, tail = n - n % BLOCK, n % BLOCK
    step = max(BLOCK, piece - piece % BLOCK)
    # Hold back the last block when a tail will overwrite part of it.
    held_from = whole - BLOCK if tail else whole
    done = 0
    while done < held_from:
        k = min(step, held_from - done)
        yield torch.randn(k, generator=gen, dtype=dtype)
        done += k
    if not tail:
        return
    last_block = torch.randn(BLOCK, generator=gen, dtype=dtype)
    torch.rand(tail, generator=gen, dtype=dtype)  # the uniforms torch draws, then overwrites
    fresh = torch.randn(BLOCK, generator=gen, dtype=dtype)
    yield torch.cat([last_block[:tail], fresh])  # values n-16-tail .. n-1


def followed_by_zeros(pieces: Iterator[torch.Tensor], n: int, dtype: torch.dtype,
                      piece: int = PIECE) -> Iterator[torch.Tensor]:
    """``pieces``, then ``n`` zeros in pieces of at most ``piece`` elements: the padded
    vocabulary rows, which the serial init leaves at zero without drawing them
    (`trainer.model.gpt.drawn_rows`)."""
    yield from pieces
    for done in range(0, n, piece):
        yield torch.zeros(min(piece, n - done), dtype=dtype)


def shard_of_stream(pieces: Iterator[torch.Tensor], shape: torch.Size, spec: ShardSpec | None,
                    rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s `shard_tensor` of the tensor of ``shape`` whose values arrive, flat and in
    order, as ``pieces`` (every piece is consumed). Rows along dim 0 are cut as they complete,
    so only one piece and one row are held beyond the shard."""
    if not shape:
        return torch.cat(list(pieces)).reshape(shape)
    row = shape[1:].numel()
    rows_kept = None
    if spec is not None and spec.dim == 0 and size > 1:
        rows_kept = shard_tensor(torch.arange(shape[0]), rank, size, spec)  # ascending
    out: list[torch.Tensor] = []
    pending = torch.empty(0)
    first_row = 0
    for piece in pieces:
        pending = torch.cat([pending.to(piece.dtype), piece])
        full = pending.numel() // row
        if not full:
            continue
        block = pending[: full * row].reshape(full, *shape[1:])
        pending = pending[full * row:].clone()
        out.append(_cut(block, first_row, rows_kept, spec, rank, size))
        first_row += full
    return torch.cat(out) if out else torch.empty(0, *shape[1:])


def _cut(block: torch.Tensor, first_row: int, rows_kept: torch.Tensor | None,
         spec: ShardSpec | None, rank: int, size: int) -> torch.Tensor:
    """This rank's part of rows ``first_row ..`` of the full tensor."""
    if spec is None or size == 1:
        return block.clone()
    if rows_kept is None:  # cut along a later dimension: every row contributes
        return shard_tensor(block, rank, size, spec)
    mine = rows_kept[(rows_kept >= first_row) & (rows_kept < first_row + block.shape[0])]
    return block.index_select(0, mine - first_row)
