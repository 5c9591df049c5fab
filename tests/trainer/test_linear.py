"""The models' linear kernel: oneDNN for fp32 on a CPU is ``F.linear`` up to fp32 rounding,
forward and backward, deterministic; any other dtype, and tracers, get ``F.linear`` itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.numerics import U32, assert_within_order
from trainer.model import linear as kernels
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.model.linear import Linear, linear, onednn_linear

needs_onednn = pytest.mark.skipif(kernels._LINEAR is None, reason="this torch has no oneDNN")


def _grads(fn, x, w, b, g):  # noqa: ANN001, ANN202 - a local helper
    y = fn(x, w, b)
    return (y, *torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], g))


@needs_onednn
@pytest.mark.parametrize(("shape", "bias"), [((4, 32, 48), True), ((64, 40), False),
                                             ((2, 3, 5, 16), True)])
def test_onednn_linear_is_torchs_linear_up_to_fp32_rounding_forward_and_backward(
        shape: tuple[int, ...], bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen, requires_grad=True)
    w = torch.randn(24, shape[-1], generator=gen, requires_grad=True)
    b = torch.randn(24, generator=gen, requires_grad=True) if bias else None
    g = torch.randn(*shape[:-1], 24, generator=gen)
    got, want = _grads(onednn_linear, x, w, b, g), _grads(F.linear, x, w, b, g)
    rows = x.numel() // shape[-1]
    # Magnitudes: the same products on absolute values; terms: the length of each sum.
    ax, aw, ag = x.detach().abs(), w.detach().abs(), g.abs()
    ab = b.detach().abs() if b is not None else None
    checks = [("y", F.linear(ax, aw, ab), shape[-1] + 1), ("dx", ag @ aw, 24),
              ("dw", ag.reshape(rows, 24).t() @ ax.reshape(rows, -1), rows)]
    if b is not None:
        checks.append(("db", ag.reshape(rows, 24).sum(0), rows))
    for (name, magnitude, terms), mine, theirs in zip(checks, got, want, strict=True):
        assert_within_order(mine.detach(), theirs.detach(), n_terms=terms,
                            magnitude=magnitude, unit=U32, name=name)


@needs_onednn
def test_onednn_linear_gives_the_same_bits_every_time_and_for_strided_inputs() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 8, 32, generator=gen).transpose(0, 1)  # not contiguous
    w = torch.randn(20, 32, generator=gen)
    assert torch.equal(onednn_linear(x, w), onednn_linear(x, w))
    assert torch.equal(onednn_linear(x, w), onednn_linear(x.contiguous(), w))


def test_other_dtypes_and_devices_take_torchs_linear_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float64, torch.bfloat16):
        x = torch.randn(6, 16, generator=gen).to(dtype)
        w = torch.randn(4, 16, generator=gen).to(dtype)
        assert torch.equal(linear(x, w), F.linear(x, w))
    meta = linear(torch.empty(3, 16, device="meta"), torch.empty(4, 16, device="meta"))
    assert meta.shape == (3, 4) and meta.device.type == "meta"


def test_fp64_gradients_of_the_kernel_pass_torchs_gradcheck() -> None:
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(linear, (x, w, b))


def test_plain_ops_put_every_linear_of_the_model_on_torchs_op_and_back() -> None:
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16))
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 4 + 1  # qkv, proj, fc, proj per block; the head
    assert all(m.kernel is linear for m in linears)
    model.use_plain_ops(True)
    assert all(m.kernel is F.linear for m in linears)
    model.use_plain_ops(False)
    assert all(m.kernel is linear for m in linears)
