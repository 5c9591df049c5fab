"""Global gradient-norm clipping for a model split over model-parallel groups.

The norm must be the serial model's: every *distinct* gradient element counted exactly once.
A rank sums the squares of the gradients it *counts*, the sums are all-reduced over every
model-parallel group the parameters are spread across, and every rank clips with the same
global norm. Two bugs this avoids: clipping with the local norm only (torchtitan#596, a PP
stage saw just its own layers) and counting replicated parameters once per rank
(ROCm/TransformerEngine#715, norms 1.4-1.5x too big).

A `NormScope` says which groups to sum over and which tensors this rank counts. A run's scope
(`trainer.training.run`) is one rule for every layout, read from each tensor's placement
(`trainer.placement.leads`): summed over the world, each rank counts the tensors it *leads*,
those of which it is the first replica (a TP-replicated norm weight on TP rank 0, a dense
weight on DP rank 0, a weight replicated over part of dp on the first rank of that part, a
ZeRO-1 piece everywhere, the tied
copy on the last pipeline stage never).

The arithmetic follows ``torch.nn.utils.clip_grad_norm_`` (per-tensor norms, coefficient
``max_norm / (norm + 1e-6)`` capped at 1), so at TP = 1 the result equals it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from trainer.comm.protocol import Communicator, ReduceOp
from trainer.model.precision import at_least_fp32

Counts = Callable[[nn.Parameter], bool]


def _every(_: nn.Parameter) -> bool:
    return True


@dataclass(frozen=True)
class NormScope:
    """The groups a gradient norm is summed over and the parameters this rank counts in it."""

    groups: tuple[Communicator, ...] = ()
    counts: Counts = _every



def global_grad_norm(params: Iterable[nn.Parameter], scope: NormScope = NormScope()
                     ) -> torch.Tensor:
    """The L2 norm of every gradient of the whole (unsplit) model, as a 0-d fp32 tensor;
    collective over ``scope``'s groups."""
    params = [p for p in params if p.grad is not None]
    grads = [cast(torch.Tensor, p.grad) for p in params]  # none is None here
    device = grads[0].device if grads else torch.device("cpu")
    counted = [g.detach() for p, g in zip(params, grads, strict=True) if scope.counts(p)]
    norms = torch._foreach_norm(counted, 2) if counted else []
    if not scope.groups:  # exactly torch.nn.utils.clip_grad_norm_'s arithmetic
        if not norms:
            return torch.zeros((), device=device)
        norm: torch.Tensor = torch.linalg.vector_norm(
            torch.stack([at_least_fp32(n) for n in norms]))
        return norm
    squares = torch.stack([at_least_fp32(n) for n in norms]).square().sum() if norms else \
        torch.zeros((), device=device)
    squares = squares.reshape(1).contiguous()
    for comm in scope.groups:
        comm.all_reduce(squares, ReduceOp.SUM)
    return squares.sqrt().reshape(())


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float,
                   scope: NormScope = NormScope()) -> torch.Tensor:
    """Scale every gradient so the global norm is at most ``max_norm`` (0 only measures).
    Returns the norm before clipping, a 0-d tensor on the device (reading it would make the
    host wait for the GPU); every rank of the scope gets the same value."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, scope)
    if max_norm > 0 and params:
        # The coefficient in fp32 tensors, as torch computes it, so TP = 1 matches it exactly.
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = [cast(torch.Tensor, p.grad) for p in params]  # none is None here
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm
