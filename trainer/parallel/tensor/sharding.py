"""How a full (serial) tensor is cut into tensor-parallel shards, and put back together.

A sharded parameter carries a `ShardSpec` (``param.tp_shard``): the dimension it is cut along
and the *stride*. With stride 1, rank ``r`` of ``n`` owns the ``r``-th of ``n`` equal blocks.
With stride ``s``, the dimension is first cut into ``s`` equal parts that are sharded
independently, and rank ``r`` owns block ``r`` of every part, in order: the fused QKV weight
``[q; k; v]`` uses stride 3, so each rank holds ``[q_r; k_r; v_r]`` (its own heads of each)
and can run attention on them without talking to anyone (Megatron's ``partition_stride``).

A parameter without ``tp_shard`` is replicated: every TP rank holds the same full copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trainer.comm.protocol import Communicator
from trainer.errors import TrainerError


class TensorParallelError(TrainerError):
    """A model or layer cannot be split over the tensor-parallel group as asked."""


def check_divisible(what: str, value: int, size: int, where: str, fix: str) -> None:
    """Raise unless ``value`` (a dimension called ``what``) splits evenly over ``size`` ranks."""
    if value % size:
        raise TensorParallelError(
            "model does not split over the tensor-parallel group", where,
            f"{what} = {value} is not divisible by tp = {size}", fix)


@dataclass(frozen=True)
class ShardSpec:
    """Where a tensor-parallel parameter is cut: along ``dim``, in ``stride`` interleaved parts."""

    dim: int
    stride: int = 1


def mark_sharded(param: nn.Parameter, dim: int, stride: int = 1) -> nn.Parameter:
    param.tp_shard = ShardSpec(dim, stride)  # type: ignore[attr-defined]  # read by shard_spec
    return param


def shard_spec(param: torch.Tensor) -> ShardSpec | None:
    """The parameter's `ShardSpec`, or ``None`` when it is replicated across TP."""
    return getattr(param, "tp_shard", None)


def shard_tensor(full: torch.Tensor, rank: int, size: int, spec: ShardSpec) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` (a contiguous copy; the caller checked divisibility)."""
    parts = full.chunk(spec.stride, dim=spec.dim)
    return torch.cat([p.chunk(size, dim=spec.dim)[rank] for p in parts], dim=spec.dim).contiguous()


def shard_shape(shape: torch.Size, spec: ShardSpec | None, size: int) -> torch.Size:
    """The shape of one rank's shard of a tensor of ``shape`` (``spec`` None: replicated)."""
    if spec is None:
        return torch.Size(shape)
    dims = list(shape)
    dims[spec.dim] //= size
    return torch.Size(dims)


def unshard(shards: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order (inverse of `shard_tensor`)."""
    by_rank = [s.chunk(spec.stride, dim=spec.dim) for s in shards]
    parts = [torch.cat([pieces[k] for pieces in by_rank], dim=spec.dim)
             for k in range(spec.stride)]
    return torch.cat(parts, dim=spec.dim)


def gather_full(t: torch.Tensor, spec: ShardSpec | None, comm: Communicator) -> torch.Tensor:
    """The full tensor on every rank of ``comm`` (a collective; replicated tensors are cloned)."""
    local = t.detach()
    if spec is None or comm.size == 1:
        return local.clone()
    # The communicator gathers along dim 0, so move the sharded dim there and back.
    moved = local.movedim(spec.dim, 0).contiguous()
    out = moved.new_empty((comm.size * moved.shape[0], *moved.shape[1:]))
    comm.all_gather(out, moved)
    shards = [s.movedim(0, spec.dim) for s in out.chunk(comm.size, dim=0)]
    return unshard(shards, spec)


def full_state(module: nn.Module, comm: Communicator) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` re-assembled to its serial shape, by name (a collective:
    every TP rank calls it with the same module structure)."""
    return {name: gather_full(p, shard_spec(p), comm) for name, p in module.named_parameters()}
