"""Token dispatch and combine: the all-to-all that moves tokens to their experts and back.

Megatron's all-to-all dispatcher (``token_dispatcher.py``) on the `Communicator`. The E experts
are split over the P members of the expert-parallel (EP) group in contiguous blocks of
L = E/P (member p holds experts p*L .. p*L+L-1). Dispatch, for the N tokens of this rank:

1. permute: every kept (token, expert) assignment becomes one row, rows sorted by expert
   (stable, so each expert's rows stay in token order);
2. count exchange: an equal-block all-to-all of the (P, L) per-expert counts tells each member
   how many rows it gets from every member for each of its experts;
3. all-to-all of the rows over EP with those split sizes (uneven, possibly empty);
4. sort the received rows by local expert (they arrive grouped by source member), so each local
   expert reads one contiguous chunk.

Combine is the exact reverse: un-sort, all-to-all back, and the probability-weighted sum of the
k outputs of each token (``index_add``; dropped assignments add nothing). Every step is a
gather, a scatter-add or an all-to-all, whose adjoints are each other, so autograd's backward of
dispatch *is* a combine and vice versa: `_AllToAll.backward` runs the all-to-all with the split
sizes swapped. With P = 1 (or no EP group) steps 2-4 vanish and the rows stay on the rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import Function

from trainer.comm.protocol import Communicator
from trainer.model.precision import at_least_fp32
from trainer.parallel.expert.router import Routing


@dataclass(frozen=True)
class DispatchPlan:
    """What one dispatch did; its combine undoes it."""

    token_of: torch.Tensor
    """(M,) the local token each sent row was copied from."""
    weight: torch.Tensor
    """(M,) the combine weight of each sent row (differentiable)."""
    local_counts: list[int]
    """Rows per local expert after the exchange (the chunks the experts run on)."""
    in_splits: list[int]
    """Rows sent to each EP member (received back from it by the combine)."""
    out_splits: list[int]
    """Rows received from each EP member."""
    sort_index: torch.Tensor | None
    """Received row -> expert-major position, None without an exchange."""
    ep: Communicator | None = None
    """The group the rows were exchanged over (None: they stayed on this rank)."""


def dispatch(x_ND: torch.Tensor, routing: Routing, n_experts: int,
             ep: Communicator | None = None) -> tuple[torch.Tensor, DispatchPlan]:
    """Rows for this rank's local experts, grouped by expert, and the plan to combine them."""
    n_tokens, k = routing.experts.shape
    flat_expert, kept = routing.experts.flatten(), routing.kept.flatten()
    flat_token = torch.arange(n_tokens, device=x_ND.device).repeat_interleave(k)
    chosen = kept.nonzero().squeeze(1)
    order = chosen[torch.sort(flat_expert[chosen], stable=True).indices]
    token_of, weight = flat_token[order], routing.weights.flatten()[order]
    counts = torch.bincount(flat_expert[order], minlength=n_experts)
    rows = x_ND[token_of]
    if ep is None or ep.size == 1:
        counts_list = counts.tolist()
        return rows, DispatchPlan(token_of, weight, counts_list, [len(order)], [len(order)], None)
    members = ep.size
    sent = counts.view(members, n_experts // members).contiguous()
    received = torch.empty_like(sent)
    ep.all_to_all(received, sent)  # row p of `sent` goes to member p
    in_splits, out_splits = sent.sum(1).tolist(), received.sum(1).tolist()
    rows = all_to_all(rows, ep, in_splits, out_splits)
    sort_index = _expert_major(received)
    plan = DispatchPlan(token_of, weight, received.sum(0).tolist(), in_splits, out_splits,
                        sort_index, ep)
    return rows[sort_index], plan


def combine(y_rows: torch.Tensor, plan: DispatchPlan, n_tokens: int) -> torch.Tensor:
    """(N, D) sum over each token's kept assignments of weight * expert output (at least fp32)."""
    if plan.sort_index is not None and plan.ep is not None:
        y_rows = y_rows[torch.argsort(plan.sort_index)]
        y_rows = all_to_all(y_rows, plan.ep, plan.out_splits, plan.in_splits)
    weighted = at_least_fp32(y_rows) * plan.weight.to(at_least_fp32(y_rows).dtype)[:, None]
    out = weighted.new_zeros((n_tokens, y_rows.shape[1]))
    return out.index_add(0, plan.token_of, weighted)


def _expert_major(received_PL: torch.Tensor) -> torch.Tensor:
    """Index that reorders rows grouped (source member, local expert) into (expert, member)."""
    members, local = received_PL.shape
    chunk = torch.arange(members * local, device=received_PL.device)
    chunk_of_row = chunk.repeat_interleave(received_PL.flatten())
    expert_major_key = (chunk_of_row % local) * members + chunk_of_row // local
    return torch.sort(expert_major_key, stable=True).indices


def all_to_all(x: torch.Tensor, comm: Communicator, in_splits: list[int],
               out_splits: list[int]) -> torch.Tensor:
    """Differentiable variable all-to-all along dim 0; its backward swaps the splits."""
    out: torch.Tensor = _AllToAll.apply(x, comm, in_splits, out_splits)  # type: ignore[no-untyped-call]  # torch's Function.apply
    return out


class _AllToAll(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, in_splits: list[int],
                out_splits: list[int]) -> torch.Tensor:
        ctx.comm, ctx.splits = comm, (in_splits, out_splits)
        return _exchange(x, comm, in_splits, out_splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        in_splits, out_splits = ctx.splits
        return _exchange(grad, ctx.comm, out_splits, in_splits), None, None, None


def _exchange(x: torch.Tensor, comm: Communicator, in_splits: list[int],
              out_splits: list[int]) -> torch.Tensor:
    # A private contiguous copy: autograd may hand the same tensor to several consumers.
    inp = x.detach().contiguous()
    out = inp.new_empty((sum(out_splits), *inp.shape[1:]))
    comm.all_to_all(out, inp, in_splits=in_splits, out_splits=out_splits)
    return out
