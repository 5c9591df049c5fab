"""Tolerances for comparing a parallel run with the single-process model, derived, not tuned.

Both sides run in fp64 (`float64()`; trainer/model/precision.py keeps an fp64 model in fp64 end to
end), so they differ only by rounding in another summation order: data parallelism adds the
per-rank gradients in another order, tensor parallelism splits matmuls and softmax sums,
pipelining changes nothing but where the sums run, and MPICH picks its all-reduce algorithm (and
so the order) by message size. The bounds below hold on any IEEE-754 machine whatever the order.

- A sum of n terms in any order has an error of at most (n-1)·u·Σ|x_i| (Higham, Accuracy and
  Stability of Numerical Algorithms, eq. 4.4), u = 2^-53; two orders differ by at most twice
  that. `reduction_rtol(n)` is that bound relative to Σ|x_i|.
- A value computed through a chain of such sums (a matmul feeding a GELU feeding a matmul, and
  backward through them) differs by at most `reduction_rtol(N)` times its *magnitude*, N the
  terms of every sum on the chain added up, the magnitude the same chain evaluated on absolute
  values: |W|, |x|, each nonlinearity replaced by a bound on its slope (first order; Higham
  §3.5). A test measures the magnitude on its own data (`within_order`): assuming it is O(1)
  fails as soon as weights, activations or the tokens a gradient sums over grow.
- Adam's update lr·m/(√v + eps) changes by at most about lr·δ/eps when one gradient element
  changes by δ (the derivative of g/(|g| + eps) peaks at 1/eps for g near 0). `adam_atol` adds
  that up over the steps (first order: fp64 rounding, ~1e-14, is far below eps, so no element
  can cross from one regime of the update to another).

A real bug (a wrong shard, a missing 1/dp, a skipped bucket) moves losses by far more than
`reduction_rtol` and parameters by the order of one update, lr: the bounds sit many orders of
magnitude below both, so they separate rounding from bugs on Intel and AMD alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

U64 = 2.0**-53  # fp64 unit roundoff
U32 = 2.0**-24  # fp32 unit roundoff
U_BF16 = 2.0**-8  # bf16 unit roundoff
BF16_LAMBDA = 5.0  # standard deviations of a random-walk rounding sum (test_mixed_precision.py)
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which trainer/optim/optimizer.py keeps


@contextmanager
def float64() -> Iterator[None]:
    """Build models (and run everything they do) in fp64 inside this block."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def reduction_rtol(n_terms: int, unit: float = U64) -> float:
    """Relative difference of two sums of ``n_terms`` terms in different orders."""
    return 2.0 * max(1, n_terms - 1) * unit


def order_bound(n_terms: int, magnitude: torch.Tensor, unit: float = U64) -> torch.Tensor:
    """Per-element bound on the difference of two evaluations in different summation orders of
    a value whose chain of sums has ``n_terms`` terms in all and whose ``magnitude`` (the chain
    on absolute values, see above) the test measured."""
    return reduction_rtol(n_terms, unit) * magnitude


def assert_within_order(got: torch.Tensor, want: torch.Tensor, *, n_terms: int,
                        magnitude: torch.Tensor, unit: float = U64, name: str = "") -> None:
    """``got`` equals ``want`` element by element to `order_bound` (the shapes must match)."""
    assert got.shape == want.shape == magnitude.shape, (name, got.shape, want.shape,
                                                        magnitude.shape)
    bound = order_bound(n_terms, magnitude.to(torch.float64), unit)
    excess = (got.double() - want.double()).abs() - bound
    if excess.numel() and float(excess.max()) > 0:
        at = int(excess.argmax())
        raise AssertionError(
            f"{name}: {int((excess > 0).sum())} of {excess.numel()} elements differ by more "
            f"than rounding of {n_terms} terms allows; at flat index {at}: "
            f"|{float(got.flatten()[at])!r} - {float(want.flatten()[at])!r}| > "
            f"{float(bound.flatten()[at]):.3e} (magnitude {float(magnitude.flatten()[at]):.3e})")


def adam_atol(*, steps: int, lr: float, n_terms: int, grad_scale: float,
              unit: float = U64) -> float:
    """Parameter difference after ``steps`` AdamW steps whose gradient elements differ only by
    rounding: each a sum of at most ``n_terms`` terms whose magnitudes add up to at most
    ``grad_scale``, measured by the reference run (`serial_reference.token_term_scale`: the
    tokens' parts of a gradient element, the mean loss dividing each by n)."""
    return steps * lr / ADAM_EPS * reduction_rtol(n_terms, unit) * grad_scale


def loss_atol(*, steps: int, lr: float, n_params: int, n_terms: int, grad_scale: float,
              unit: float = U64) -> float:
    """Loss difference after ``steps`` AdamW steps, beyond the loss's own rounding.

    To first order the loss moves by Σ g_i·δθ_i, and Adam's amplification of a gradient
    difference δ_i is largest exactly where g_i is small: |g_i|·lr·δ_i/(|g_i| + eps) <= lr·δ_i.
    So the loss difference is at most lr·Σ δ_i per step, with no 1/eps in it."""
    return steps * lr * n_params * reduction_rtol(n_terms, unit) * grad_scale


def norm_atol(*, n_params: int, n_terms: int, grad_scale: float, unit: float = U64) -> float:
    """Difference of two gradient norms whose elements differ only by rounding (`adam_atol`'s
    gradients): the 2-norm of a difference of at most reduction_rtol·grad_scale per element."""
    return n_params**0.5 * reduction_rtol(n_terms, unit) * grad_scale


def bf16_tracking(fp32: dict, *, k: int, extra_grad: int = 0) -> tuple[list[float], float]:
    """How far a bf16 run with ``k`` roundings per forward (``extra_grad`` more in backward) can
    be from the exact run: (the loss tolerance of every step, the weights' drift after the
    last), from the fp32 run's "losses", "norms" and "lrs" (derived in
    tests/trainer/test_mixed_precision.py's docstring: rounding as a random walk of λ = 5
    standard deviations, Adam's update at most lr per element)."""
    r = BF16_LAMBDA * math.sqrt(2 * k + extra_grad) * U_BF16
    out, drift = [], 0.0
    for loss, norm, lr in zip(fp32["losses"], fp32["norms"], fp32["lrs"], strict=True):
        out.append(BF16_LAMBDA * math.sqrt(k) * U_BF16 * loss + BF16_LAMBDA * norm * drift)
        drift += 2 * r * lr
    return out, drift


def f64(values: list[float]) -> torch.Tensor:
    """A list of losses (or norms) as an fp64 tensor, for comparing with assert_close."""
    return torch.tensor(values, dtype=torch.float64)


def attention_atol(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                   blocks: int, scale: float, unit: float = U64) -> dict[str, float]:
    """Largest difference of causal attention's output and its q, k, v gradients between two
    evaluations that differ in summation order and in how the softmax is split into blocks
    merged with the log-sum-exp rule (context parallelism vs one process), first order in u.

    q (B, H, T, K); k, v (B, G, T, K); ``blocks``: the most partial results merged into one
    query row. With A = scale·K·max|q|·max|k| bounding every score and Λ = A + log T every
    log-sum-exp: a score differs by reduction_rtol(K + 4)·A (K products and sums, the scale,
    and torch's math kernel scaling q and k by √scale each); a probability p = e^(s - L)
    relatively by twice that (s and L) plus reduction_rtol(T) (the sum of exponentials in L)
    plus 2(blocks + 3)·u·(1 + Λ) (each merge's and the final exp/log/subtraction's rounding of
    an argument of size Λ, on both sides). Then o = Σ p·v (Σ p = 1), dV = Σ_rows p·dO over
    R·T query rows (R query heads per K/V head), dS = p(dP - Δ) with dP, Δ sums of K terms of
    size at most W = K·max|dO|·max|v|, dQ = scale·Σ dS·k, dK = scale·Σ_rows dS·q."""
    T, n_k, rows = q.shape[2], q.shape[3], q.shape[1] // k.shape[1] * q.shape[2]
    qm, km, vm, gm = (float(t.abs().max()) for t in (q, k, v, dout))
    score = scale * n_k * qm * km
    lse = score + math.log(T)
    e_s = reduction_rtol(n_k + 4, unit) * score
    e_p = 2 * e_s + reduction_rtol(T, unit) + 2 * (blocks + 3) * unit * (1 + lse)
    out = (e_p + reduction_rtol(T + 1, unit)) * vm
    w = n_k * gm * vm
    e_ds = e_p * 2 * w + 2 * reduction_rtol(n_k + 1, unit) * w + n_k * gm * out
    return {  # sums of n products differ by reduction_rtol(n + 1); the scale adds one more
        "out": out,
        "dq": scale * km * (e_ds + reduction_rtol(T + 2, unit) * 2 * w),
        "dk": scale * qm * rows * (e_ds + reduction_rtol(rows + 2, unit) * 2 * w),
        "dv": rows * gm * (e_p + reduction_rtol(rows + 1, unit)),
    }
