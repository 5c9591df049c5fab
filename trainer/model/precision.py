"""Precision rules shared by the model and the parallel layers.

Losses, softmax statistics, gradient norms and the data-parallel main gradients are kept in at
least fp32: half-precision tensors are upcast, fp32 stays fp32, and fp64 stays fp64. The last
rule lets a model built in fp64 run in fp64 end to end, which is how the equivalence tests get a
reference whose rounding error is far below any real bug (tests/support/numerics.py).
"""

from __future__ import annotations

import torch


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` upcast to fp32 unless it is already fp32 or wider."""
    return t if t.dtype == torch.float64 else t.float()


def main_grad_dtype(dtypes: set[torch.dtype]) -> torch.dtype:
    """The dtype of the gradient buffer for parameters of these dtypes: fp32, or fp64 when any
    parameter is fp64 (accumulating an fp64 gradient in fp32 would lose its precision)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32
