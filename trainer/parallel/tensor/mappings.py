"""The f/g operators of Megatron tensor parallelism: collectives with their autograd adjoints.

Every TP layer is built from these; each is an identity on a TP group of one. The backward of
each is the adjoint of its forward, which is what makes the sharded model's gradients equal the
serial model's (Shoeybi et al. 2019, "f" and "g"; Megatron ``tensor_parallel/mappings.py``)::

    function                            forward                    backward
    copy_to_region              (f)     identity                   all-reduce
    reduce_from_region          (g)     all-reduce                 identity
    scatter_to_region                   keep own last-dim block    all-gather last dim
    gather_from_region                  all-gather last dim        keep own last-dim block
    scatter_to_sequence_region          keep own sequence block    all-gather sequence dim
    reduce_scatter_to_sequence_region   reduce-scatter seq. dim    all-gather sequence dim
    linear_on_gathered_sequence         all-gather sequence dim,   all-gather it again, then
                                        then x W^T + b             reduce-scatter the input grad

The last is Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` under sequence
parallelism: the column-parallel matmul's input is saved as the rank's sequence block and
gathered again in backward, so what is kept for backward is 1/tp of the gathered input.

Activations here are batch-first ``(B, T, D)``, so the sequence dimension is 1 (Megatron's
are ``(T, B, D)``); every sequence function takes ``dim``. The `Communicator` gathers and
scatters along dim 0, so the helpers move the working dimension there and back.

Collectives never run on autograd's own buffers: the forward reduces a private copy (the input
may be saved by another function for its backward) and the backward a contiguous copy of the
incoming gradient (autograd may hand the same gradient tensor to several consumers).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd import Function

from trainer.comm.protocol import Communicator, ReduceOp


def all_reduce(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    out = x.detach().clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, ReduceOp.SUM)
    return out


def split(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim`` (no communication)."""
    return x.chunk(comm.size, dim=dim)[comm.rank].contiguous()


def all_gather(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order."""
    moved = x.detach().movedim(dim, 0).contiguous()
    out = moved.new_empty((comm.size * moved.shape[0], *moved.shape[1:]))
    comm.all_gather(out, moved)
    return out.movedim(0, dim).contiguous()


def reduce_scatter(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's block along ``dim``."""
    moved = x.detach().movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // comm.size, *moved.shape[1:]))
    comm.reduce_scatter(out, moved, ReduceOp.SUM)
    return out.movedim(0, dim).contiguous()


class _CopyToRegion(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad, ctx.comm), None


class _ReduceFromRegion(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        return all_reduce(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Scatter(Function):
    """Forward keeps this rank's block along ``dim``; backward all-gathers along it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return split(x, comm, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather(grad, ctx.comm, ctx.dim), None, None


class _Gather(Function):
    """Forward all-gathers along ``dim``; backward keeps this rank's block."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return all_gather(x, comm, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return split(grad, ctx.comm, ctx.dim), None, None


class _LinearOnGatheredSequence(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                comm: Communicator, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.has_bias = comm, dim, bias is not None
        ctx.save_for_backward(x, weight)  # the sequence block, not the gathered input
        return F.linear(all_gather(x, comm, dim), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        full = all_gather(x, ctx.comm, ctx.dim)
        grad_x = reduce_scatter(grad.matmul(weight), ctx.comm, ctx.dim)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_w = grad_2d.t().matmul(full.reshape(-1, full.shape[-1]))
        grad_b = grad_2d.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return reduce_scatter(x, comm, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather(grad, ctx.comm, ctx.dim), None, None


def copy_to_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """f: enter a TP region with a replicated input (backward sums the ranks' input grads)."""
    return x if comm.size == 1 else _CopyToRegion.apply(x, comm)  # type: ignore[no-untyped-call]  # torch's Function.apply


def reduce_from_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """g: leave a TP region by summing the ranks' partial outputs."""
    return x if comm.size == 1 else _ReduceFromRegion.apply(x, comm)  # type: ignore[no-untyped-call]  # torch's Function.apply


def scatter_to_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Keep this rank's block of the last dimension."""
    return x if comm.size == 1 else _Scatter.apply(x, comm, -1)  # type: ignore[no-untyped-call]  # torch's Function.apply


def gather_from_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """All-gather the last dimension (backward keeps this rank's block)."""
    return x if comm.size == 1 else _Gather.apply(x, comm, -1)  # type: ignore[no-untyped-call]  # torch's Function.apply


def scatter_to_sequence_region(x: torch.Tensor, comm: Communicator, dim: int = 1
                               ) -> torch.Tensor:
    """Sequence parallelism: keep this rank's block of the sequence."""
    return x if comm.size == 1 else _Scatter.apply(x, comm, dim)  # type: ignore[no-untyped-call]  # torch's Function.apply


def linear_on_gathered_sequence(x: torch.Tensor, weight: torch.Tensor,
                                bias: torch.Tensor | None, comm: Communicator,
                                dim: int = 1) -> torch.Tensor:
    """Sequence parallelism: a column-parallel layer's ``F.linear`` on the all-gathered
    sequence, keeping only this rank's block for backward."""
    if comm.size == 1:
        return F.linear(x, weight, bias)
    out: torch.Tensor = _LinearOnGatheredSequence.apply(x, weight, bias, comm, dim)  # type: ignore[no-untyped-call]  # torch's Function.apply
    return out


def reduce_scatter_to_sequence_region(x: torch.Tensor, comm: Communicator, dim: int = 1
                                      ) -> torch.Tensor:
    """Sequence parallelism: sum a row-parallel layer's partial outputs, keep own sequence."""
    return x if comm.size == 1 else _ReduceScatter.apply(x, comm, dim)  # type: ignore[no-untyped-call]  # torch's Function.apply
