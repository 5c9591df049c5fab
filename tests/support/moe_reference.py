"""The serial reference of a mixture-of-experts layer: every expert on one rank, plain loops.

Written from the definitions (Switch / Megatron), sharing no code with
`trainer.parallel.expert` beyond the parameters: token by token it scores the experts, picks
the top k, and adds each chosen expert's output times its score; capacity is applied expert
by expert from a sorted list of that expert's assignments; the auxiliary losses are summed term
by term. `use_reference` points every MoE
layer of a model at it, so a whole training run can be compared with the parallel layouts.
"""

from __future__ import annotations

import math
from types import MethodType

import torch
from torch import nn

from trainer.parallel.expert.layer import MoE, moe_layers


def reference_moe(layer: MoE, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, auxiliary loss) of ``layer`` on ``x_BTD``, computed the slow, obvious way."""
    x = x_BTD.reshape(-1, x_BTD.shape[-1])
    n, e, k = x.shape[0], layer.n_experts, layer.topk
    logits = [x[t].to(torch.promote_types(x.dtype, torch.float32)) @ layer.router.weight.t()
              for t in range(n)]
    scores = [lg.softmax(-1) if layer.score == "softmax" else lg.sigmoid() for lg in logits]
    chosen = [_top(s, k) for s in scores]  # (weights, experts) of each token
    assignments = {i: [] for i in range(e)}
    for t in range(n):
        for j in range(k):
            assignments[int(chosen[t].indices[j])].append((t, j))
    kept = {(t, j) for t in range(n) for j in range(k)}
    if layer.capacity_factor > 0:
        cap = math.ceil(n * k * layer.capacity_factor / e)
        # Scores within one cell of the grid are ties (the router's stated rule: equal in exact
        # arithmetic, a few ulps apart in any order of sums); the grid is a power of two.
        grid = 2.0 ** (math.log2(torch.finfo(logits[0].dtype).eps) // 2)

        def cell(tj: tuple[int, int]) -> int:
            return math.floor(float(chosen[tj[0]].values[tj[1]].detach()) / grid)

        for items in assignments.values():
            ranked = sorted(items, key=lambda tj: (-cell(tj), tj[0] * k + tj[1]))
            kept -= set(ranked[cap:])
    out = [x.new_zeros(x.shape[1], dtype=logits[0].dtype) for _ in range(n)]
    for t, j in sorted(kept):
        expert = layer.experts[str(int(chosen[t].indices[j]))]
        out[t] = out[t] + chosen[t].values[j] * expert(x[t:t + 1])[0]
    aux = logits[0].new_zeros(())
    if layer.aux_coeff:
        for i in range(e):
            fraction = len(assignments[i]) / (n * k)
            mean = sum(_normalised(s, layer.score)[i] for s in scores) / n
            aux = aux + layer.aux_coeff * e * fraction * mean
    if layer.z_coeff:
        aux = aux + layer.z_coeff * sum(torch.logsumexp(lg, -1) ** 2 for lg in logits) / n
    return torch.stack(out).to(x.dtype).view_as(x_BTD), aux


# Slope bounds of GELU (x·Φ(x)): |gelu(z)| <= |z|, |gelu'| <= 1.13 and |gelu''| <= 2·φ(0) < 0.8.
GELU_SLOPE, GELU_CURVE = 1.13, 0.8


def chain_terms(layer: MoE, n_tokens: int) -> int:
    """Terms of every sum from the input to a gradient element of ``layer`` run on ``n_tokens``
    tokens, added up: forward the router's logits (D) and softmax (E), an expert's fc (D + bias)
    and proj (hidden + bias), the combine (k); backward the same again, a weight gradient's sum
    over the tokens and the k + 1 paths that meet in the input's gradient."""
    d, hidden = layer.router.in_features, layer.experts["0"].proj.in_features
    forward = d + layer.n_experts + d + hidden + layer.topk + 2
    return 2 * forward + n_tokens + layer.topk + 1


def magnitudes(layer: MoE, x_BTD: torch.Tensor, upstream: torch.Tensor) -> dict[str, torch.Tensor]:
    """The magnitude (tests/support/numerics.py) of every value `compare_with_reference` checks,
    for the
    loss ``(out * upstream).sum() + aux``: "out", "aux", "x" (its gradient) and each parameter's
    name (its gradient), measured on these weights and tokens.

    The layer is evaluated on absolute values, with each nonlinearity replaced by a majorant
    whose slope bounds the real one's, so that autograd's gradients of the majorant are the
    sums of the magnitudes of the real gradients' terms (non-negative: nothing cancels):

    - expert: |x| -> |W1|·+|b1| -> Mz·(1.13 + 0.8·Mz) -> |W2|·+|b2|; the quadratic part covers
      the error of gelu'(z) that an error in z brings into backward.
    - combine weight of a chosen expert: s·(1 + 2·L), s its score, L the token's logits'
      magnitude Σ_e (|W_r|·|x|)_e; a softmax or sigmoid score moves by at most 2·s times the
      largest change of a logit, so the majorant's slope in L bounds each logit's gradient.
    - auxiliary losses: z-loss c_z·(|lse| + L)²/N, load balancing c_a·E·(1 + 2·ΣL/N) (each
      score's gradient is at most 2 times its logit's, the fractions and scores at most 1).
    Every token's assignments count, dropped or not: a bound may only grow.
    """
    x = x_BTD.detach().reshape(-1, x_BTD.shape[-1]).abs().requires_grad_()
    g = upstream.detach().reshape(x.shape).abs()
    params = {name: p.detach().abs().requires_grad_() for name, p in layer.named_parameters()}
    n = x.shape[0]
    routing = layer.route(x_BTD.detach().reshape(-1, x_BTD.shape[-1]))
    logits_mag = x @ params["router.weight"].t()
    lse = torch.logsumexp(x_BTD.detach().reshape(n, -1) @ layer.router.weight.detach().t(), -1)
    per_token = logits_mag.sum(-1, keepdim=True)
    out = x.new_zeros(x.shape)
    for e in range(layer.n_experts):
        pre = f"experts.{e}."
        z = x @ params[pre + "fc.weight"].t() + params.get(pre + "fc.bias", 0)
        h = z * (GELU_SLOPE + GELU_CURVE * z)
        y = h @ params[pre + "proj.weight"].t() + params.get(pre + "proj.bias", 0)
        weight = (routing.weights.detach().abs() * (routing.experts == e)).sum(-1, keepdim=True)
        out = out + weight * (1 + 2 * per_token) * y
    aux = x.new_zeros(())
    if layer.z_coeff:
        aux = aux + layer.z_coeff * ((lse.abs().unsqueeze(-1) + per_token) ** 2).sum() / n
    if layer.aux_coeff:
        aux = aux + layer.aux_coeff * layer.n_experts * (1 + 2 * per_token.sum() / n)
    ((out * g).sum() + aux).backward()
    found = {name: p.grad if p.grad is not None else torch.zeros_like(p)
             for name, p in params.items()}
    return {"out": out.detach().view_as(x_BTD), "aux": aux.detach(),
            "x": x.grad.view_as(x_BTD), **found}


def _top(scores: torch.Tensor, k: int) -> torch.return_types.topk:
    """The k highest scores, ties to the lower expert index (the router's stated rule)."""
    picked = sorted(range(len(scores)), key=lambda i: (-float(scores[i].detach()), i))[:k]
    index = torch.tensor(picked)
    return torch.return_types.topk((scores[index], index))


def _normalised(scores: torch.Tensor, score: str) -> torch.Tensor:
    return scores / scores.sum() if score == "sigmoid" else scores


def use_reference(model: nn.Module) -> None:
    """Make every MoE layer of ``model`` compute with `reference_moe`, its auxiliary loss
    entering backward with the layer's ``aux_scale`` as in the trainer."""
    for _, layer in moe_layers(model):
        layer.forward = MethodType(_reference_forward, layer)


def _reference_forward(layer: MoE, x_BTD: torch.Tensor) -> torch.Tensor:
    out, aux = reference_moe(layer, x_BTD)
    return _WithAux.apply(out, aux * layer.aux_scale) if torch.is_grad_enabled() else out


class _WithAux(torch.autograd.Function):
    """``out`` unchanged; in backward the auxiliary loss gets the gradient 1, as if it had been
    added to the loss the trainer differentiates."""

    @staticmethod
    def forward(ctx: object, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return out.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)
