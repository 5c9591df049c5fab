"""The linear layer's kernel: fp32 products on a CPU through oneDNN, everything else through
``F.linear``.

Why: a training step on a CPU is matrix products (74% of the ``small`` model's step in
``aten::mm``, `bench.nanogpt`), and torch runs an fp32 ``aten::mm`` on a CPU through MKL's
``sgemm``, which on an AMD CPU takes MKL's AVX2 code path even where the core has AVX-512:
99-105 GFLOP/s on one core of this machine's AMD EPYC for every product of that step, where
oneDNN (bundled with torch, which chooses its code path from the instruction set the core
reports, not its vendor) ran the same products at 211-236 GFLOP/s forward, 223-235 for the
input gradient and 126-202 for the weight gradient (2026-11-29, torch 2.13, one thread).
Torch routes an fp32 product to oneDNN only at reduced precision (bf16 or tf32 inner
products); `onednn_linear` calls oneDNN's linear at full fp32 precision, the op torch's own
compiler emits for CPU linears (``torch.ops.mkldnn._linear_pointwise``), forward and both
gradients, so the arithmetic is the same fp32 multiply-adds in another summation order (within
fp32 rounding of MKL's result) and, like MKL's, deterministic for a given shape and thread
count, which bit-exact resume needs.

Where it applies: `linear`, the default kernel of every `Linear` of the models, takes oneDNN
for fp32 tensors on a CPU when this torch has it, ``F.linear`` for any other dtype (fp64 test
models, bf16) or device, and for meta or fake tensors. Tracers (``--compile``'s blocks) get
``F.linear`` itself through the models' ``use_plain_ops`` (a compiler picks its own kernels).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

LinearKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""``kernel(x, weight, bias)``, ``F.linear``'s signature and result."""


def _onednn_op() -> Callable[..., torch.Tensor] | None:
    """oneDNN's dense linear as this torch exposes it, or None (no oneDNN in this build)."""
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


_LINEAR = _onednn_op()


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
             ) -> torch.Tensor:
    """``x @ weight.T + bias`` by oneDNN; ``x`` 2-D, any strides."""
    assert _LINEAR is not None
    return _LINEAR(x, weight, bias, "none", [], "")


def _weight_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``g.T @ x`` (out, in) for ``g`` (rows, out) and ``x`` (rows, in). The sum runs over the
    rows, the leading dimension of both, so one operand enters transposed, and oneDNN's linear
    copies a transposed *input* into rows (its weight it reads at any strides): the narrower
    operand is made the input, which copies rows x min(in, out) elements instead of rows x
    out (the ``small`` model's qkv: 2 MB, not 6, per layer)."""
    if g.shape[1] > x.shape[1]:
        return _product(x.t(), g.t(), None).t().contiguous()  # (in, out) -> (out, in): small
    return _product(g.t(), x.t(), None)


class OneDNNLinear(torch.autograd.Function):
    """``F.linear`` with oneDNN's products forward and backward: the input gradient is
    ``grad @ weight`` and the weight gradient ``grad.T @ x`` (`_weight_grad`), each one oneDNN
    linear on transposed views; the bias gradient is ``grad``'s column sum, as torch's."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None  # type: ignore[attr-defined]
        flat = x.reshape(-1, x.shape[-1])
        return _product(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors  # type: ignore[attr-defined]
        need_x, need_w, need_b = ctx.needs_input_grad  # type: ignore[attr-defined]
        g = grad.reshape(-1, grad.shape[-1])
        dx = _product(g, weight.t(), None).view(x.shape) if need_x else None
        dw = _weight_grad(g, x.reshape(-1, x.shape[-1])) if need_w else None
        db = g.sum(0) if need_b and ctx.has_bias else None  # type: ignore[attr-defined]
        return dx, dw, db


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed by oneDNN (fp32 CPU tensors)."""
    out: torch.Tensor = OneDNNLinear.apply(x, weight, bias)  # type: ignore[no-untyped-call]  # torch's Function.apply
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear``, by oneDNN where that is the faster kernel: fp32 tensors on a CPU (see
    the module's note), when this torch has it; ``F.linear`` otherwise."""
    if (_LINEAR is not None and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and weight.device.type == "cpu"):
        out: torch.Tensor = OneDNNLinear.apply(x, weight, bias)  # type: ignore[no-untyped-call]  # torch's Function.apply
        return out
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, names and init) whose product is `kernel`."""

    kernel: LinearKernel = staticmethod(linear)
    """The product: `linear` (oneDNN for fp32 on a CPU), or ``F.linear`` where a tracer must
    see torch's own op (the models' ``use_plain_ops``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias)


def use_plain_linears(model: nn.Module, plain: bool) -> None:
    """Every `Linear` of ``model`` on ``F.linear`` (True: for tracers) or on `linear`."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.kernel = F.linear if plain else linear
