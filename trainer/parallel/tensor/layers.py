"""Megatron's tensor-parallel layers on a TP `Communicator`.

* `ColumnParallelLinear`: ``Y = X A^T`` with ``A``'s output rows split over the ranks, so each
  rank computes its own slice of the output features. Input through ``f`` (copy_to_region:
  its backward sums the input gradient over ranks); output kept split unless ``gather_output``.
* `RowParallelLinear`: ``A``'s input columns split, so each rank multiplies its slice of the
  (already split) input and the partial products are summed by ``g`` (reduce_from_region). The
  bias is replicated and added once, after the sum.
* `VocabParallelEmbedding`: rank ``r`` owns token ids ``[r*V/tp, (r+1)*V/tp)``; ids outside
  that range look up row 0 and are zeroed, then ``g`` sums the ranks' outputs. Exactly one rank
  contributes each token, so the sum is exact (bit-identical to ``nn.Embedding``).

A column layer followed by a row layer costs one all-reduce forward and one backward, whatever
sits between them (attention heads, GELU), as long as it acts on each rank's slice alone.

Sequence parallelism (``sequence_parallel=True``, Korthikanti et al. 2022): activations outside
the TP region are split along the sequence (dim 1 here) instead of replicated; the column
layer all-gathers its input along the sequence and the row layer reduce-scatters its output.
Parameters applied to sequence-split activations (the row layer's bias here, norms in a model)
then get only their rank's part of the gradient, so they enter through ``copy_to_region``,
whose backward sums it over TP (Megatron-LM#1446 is that sum forgotten). The sum happens in
autograd, before any data-parallel hook sees the gradient, so DP, pipelining and recompute need
not know about it. The flag may be switched after construction
(`trainer.activations.sequence_parallel`).

Weights are never initialised here from an RNG: the ``from_*`` constructors slice the full
master weight of a serial layer, so a TP model starts exactly where the serial one does
(Megatron's ``_initialize_affine_weight_cpu``).
"""

from __future__ import annotations

from typing import TypedDict, Unpack

import torch
import torch.nn.functional as F
from torch import nn

from trainer.comm.protocol import Communicator
from trainer.parallel.tensor import mappings as m
from trainer.parallel.tensor.sharding import (
    ShardSpec,
    check_divisible,
    mark_sharded,
    shard_shape,
    shard_tensor,
)


def _sharded_param(full: torch.Tensor, comm: Communicator, spec: ShardSpec) -> nn.Parameter:
    if full.is_meta:  # per-rank construction: the shape only (`trainer.construction` fills it)
        shard = torch.empty(shard_shape(full.shape, spec, comm.size), dtype=full.dtype,
                            device="meta")
    else:
        shard = shard_tensor(full.detach(), comm.rank, comm.size, spec)
    return mark_sharded(nn.Parameter(shard), spec.dim, spec.stride)


class ColumnOptions(TypedDict, total=False):
    """`ColumnParallelLinear`'s keyword arguments (what `from_linear` passes on)."""

    stride: int
    gather_output: bool
    sequence_parallel: bool
    name: str


class RowOptions(TypedDict, total=False):
    """`RowParallelLinear`'s keyword arguments (what `from_linear` passes on)."""

    input_is_parallel: bool
    sequence_parallel: bool
    name: str


class EmbeddingOptions(TypedDict, total=False):
    """`VocabParallelEmbedding`'s keyword arguments (what `from_embedding` passes on)."""

    sequence_parallel: bool
    name: str


class ColumnParallelLinear(nn.Module):
    """Linear layer whose output features are split over the TP ranks (weight ``(out/tp, in)``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Communicator, *,
                 stride: int = 1, gather_output: bool = False, sequence_parallel: bool = False,
                 name: str = "ColumnParallelLinear") -> None:
        """``weight``/``bias`` are the *full* serial tensors; this rank keeps its slice."""
        super().__init__()
        check_divisible("output features", weight.shape[0], comm.size * stride, name,
                        "Choose sizes that divide by tp (times the stride)")
        self.comm, self.gather_output = comm, gather_output
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        spec = ShardSpec(0, stride)
        self.weight = _sharded_param(weight, comm, spec)
        self.bias = _sharded_param(bias, comm, spec) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Communicator,
                    **kwargs: Unpack[ColumnOptions]) -> ColumnParallelLinear:
        return cls(linear.weight, linear.bias, comm, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = m.linear_on_gathered_sequence(x, self.weight, self.bias, self.comm)
        else:
            y = F.linear(m.copy_to_region(x, self.comm), self.weight, self.bias)
        return m.gather_from_region(y, self.comm) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (/{self.comm.size} ranks), "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Linear layer whose input features are split over the TP ranks (weight ``(out, in/tp)``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Communicator, *,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 name: str = "RowParallelLinear") -> None:
        super().__init__()
        check_divisible("input features", weight.shape[1], comm.size, name,
                        "Choose sizes that divide by tp")
        self.comm, self.input_is_parallel = comm, input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = _sharded_param(weight, comm, ShardSpec(1))
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Communicator,
                    **kwargs: Unpack[RowOptions]) -> RowParallelLinear:
        return cls(linear.weight, linear.bias, comm, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = m.scatter_to_region(x, self.comm)
        partial = F.linear(x, self.weight)
        if not self.sequence_parallel:
            y = m.reduce_from_region(partial, self.comm)
            return y + self.bias if self.bias is not None else y
        y = m.reduce_scatter_to_sequence_region(partial, self.comm)
        # The bias meets only this rank's sequence block: sum its gradient over TP.
        return y + m.copy_to_region(self.bias, self.comm) if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (/{self.comm.size} ranks), out={self.out_features}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table whose rows (token ids) are split over the TP ranks."""

    def __init__(self, weight: torch.Tensor, comm: Communicator, *,
                 sequence_parallel: bool = False, name: str = "VocabParallelEmbedding") -> None:
        super().__init__()
        check_divisible("vocab_size", weight.shape[0], comm.size, name,
                        "Pad the vocabulary to a multiple of tp")
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.num_embeddings, self.embedding_dim = weight.shape
        self.per_rank = self.num_embeddings // comm.size
        self.vocab_start = comm.rank * self.per_rank
        self.weight = _sharded_param(weight, comm, ShardSpec(0))

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, comm: Communicator,
                       **kwargs: Unpack[EmbeddingOptions]) -> VocabParallelEmbedding:
        return cls(emb.weight, comm, **kwargs)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return F.embedding(idx, self.weight)
        outside = (idx < self.vocab_start) | (idx >= self.vocab_start + self.per_rank)
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return m.reduce_scatter_to_sequence_region(out, self.comm)
        return m.reduce_from_region(out, self.comm)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (/{self.comm.size} ranks, ids from "
                f"{self.vocab_start}), {self.embedding_dim}")

