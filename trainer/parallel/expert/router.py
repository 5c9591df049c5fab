"""The router of a mixture-of-experts layer: scores, top-k, auxiliary losses, token dropping.

Everything here is local to the tokens one forward pass of one rank sees (Megatron's rule): the
load-balancing loss, the z-loss and the capacity are computed over those tokens, so a layout
that only moves tokens between ranks (expert parallelism) computes exactly what one device
computing the same microbatch does.

* Scores: ``logits = x @ W_r.T`` in at least fp32 (`trainer.model.precision`), then softmax over the
  experts or an element-wise sigmoid. The top-k scores are the combine weights, not
  renormalised, so the router gets a gradient from the language-model loss even at k = 1
  (Switch). Ties go to the lower expert index: a stable descending sort of each token's
  scores, its first k taken (``torch.topk`` promises no order among equal scores, and on CPU
  picks others once sigmoid scores saturate at 1.0), so every device and layout routes alike.
* Load balancing (Switch / Megatron ``switch_load_balancing_loss_func``):
  ``coeff * E * sum_i f_i * P_i`` with ``f_i`` the fraction of the N*k assignments that chose
  expert i (counted before any dropping, detached) and ``P_i`` the mean score of expert i over
  the N tokens (sigmoid scores are normalised per token first). A uniform router gives coeff.
* z-loss (ST-MoE): ``coeff * mean_tokens(logsumexp(logits)^2)``.
* Capacity (``capacity_factor > 0``): each expert keeps at most ``ceil(N*k*cf/E)`` assignments,
  the highest scores first; ties keep the lower token index. Scores are ranked on a grid of
  `rank_resolution` (2^-26 in fp64, 2^-12 in fp32), scores in one cell being ties: identical
  tokens in identical contexts (a run of one character under rotary attention) have scores equal
  in exact arithmetic that come out a few ulps apart, in an order set by the BLAS kernel and the
  batch shape, so ranking the raw scores would drop other tokens on another CPU or layout.
  Dropped assignments contribute nothing (the block's residual carries the token). 0 means
  dropless, the default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainer.model.precision import at_least_fp32

SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Routing:
    """Where each of N tokens goes: its k experts, their weights and which assignments stay."""

    experts: torch.Tensor
    """(N, k) int64 expert index of every assignment."""
    weights: torch.Tensor
    """(N, k) combine weight of every assignment (differentiable, at least fp32)."""
    kept: torch.Tensor
    """(N, k) bool: False where the capacity dropped the assignment."""
    aux_loss: torch.Tensor
    """0-d load-balancing loss plus z-loss, already multiplied by their coefficients."""
    routed: torch.Tensor
    """(E,) int64 assignments per expert before dropping (for the load metrics)."""

    @property
    def dropped(self) -> int:
        return int((~self.kept).sum())


def route(x_ND: torch.Tensor, weight_ED: torch.Tensor, *, topk: int, score: str = "softmax",
          aux_coeff: float = 0.0, z_coeff: float = 0.0,
          capacity_factor: float = 0.0) -> Routing:
    """Route N tokens to ``topk`` of the E experts whose router weight is ``weight_ED``."""
    logits = at_least_fp32(x_ND) @ at_least_fp32(weight_ED).t()
    n_tokens, n_experts = logits.shape
    scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    experts = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
    weights = scores.gather(-1, experts)
    routed = torch.bincount(experts.flatten(), minlength=n_experts)
    aux = logits.new_zeros(())
    if aux_coeff and n_tokens:
        aux = aux + aux_coeff * load_balancing_loss(scores, routed, topk, score)
    if z_coeff and n_tokens:
        aux = aux + z_coeff * torch.logsumexp(logits, -1).square().mean()
    kept = torch.ones_like(experts, dtype=torch.bool)
    if capacity_factor > 0:
        kept = capacity_mask(experts, weights.detach(), n_experts,
                             capacity(n_tokens, topk, n_experts, capacity_factor))
    return Routing(experts, weights, kept, aux, routed)


def load_balancing_loss(scores_NE: torch.Tensor, routed_E: torch.Tensor, topk: int,
                        score: str) -> torch.Tensor:
    """``E * sum_i f_i * P_i`` (without the coefficient); gradients flow through the scores."""
    n_tokens, n_experts = scores_NE.shape
    if score == "sigmoid":
        scores_NE = scores_NE / (scores_NE.sum(-1, keepdim=True) + 1e-20)
    fraction = routed_E.to(scores_NE.dtype) / (n_tokens * topk)
    mean_score = scores_NE.mean(0)
    return n_experts * (fraction * mean_score).sum()


def capacity(n_tokens: int, topk: int, n_experts: int, factor: float) -> int:
    """Assignments one expert may keep: ``ceil(N * k * factor / E)``."""
    return math.ceil(n_tokens * topk * factor / n_experts)


def rank_resolution(dtype: torch.dtype) -> float:
    """The grid capacity ranks scores on: 2^-(mantissa bits // 2), a power of two so that
    ``floor(score / resolution)`` is exact, and wide enough that rounding noise (a few ulps)
    moves a score across a cell boundary with a probability of about 1e-7 in fp64."""
    resolution: float = 2.0 ** (math.log2(torch.finfo(dtype).eps) // 2)
    return resolution


def capacity_mask(experts_NK: torch.Tensor, weights_NK: torch.Tensor, n_experts: int,
                  cap: int) -> torch.Tensor:
    """True for the ``cap`` highest-weight assignments of each expert (ties, weights in one
    cell of `rank_resolution`: lower token)."""
    flat_e = experts_NK.flatten()
    flat_w = torch.floor(weights_NK.flatten() / rank_resolution(weights_NK.dtype))
    # Three stable sorts give the order (expert, weight cell descending, flat position): the
    # last key sorted is the most significant one.
    order = torch.arange(flat_e.numel(), device=flat_e.device)
    order = order[torch.sort(-flat_w[order], stable=True).indices]
    order = order[torch.sort(flat_e[order], stable=True).indices]
    counts = torch.bincount(flat_e, minlength=n_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[flat_e[order]]
    kept = torch.zeros_like(flat_e, dtype=torch.bool)
    kept[order] = rank_in_expert < cap
    return kept.view_as(experts_NK)
