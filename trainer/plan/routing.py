"""How many rows the experts' all-to-all moves for a rank per token and MoE layer: measured by
routing the run's own batches through the run's own model, or, when that cannot be done here,
the balanced routing's share.

A mixture of experts with a capacity routes by the data: how many assignments an expert drops,
and how many of the kept ones belong to experts on another member, depend on the tokens (text
repeats characters, which route alike and overflow their expert's capacity), and differ from
step to step. Random tokens, or a balanced router, overcount them. So when the run's data can
be read (`trainer.data.sources.read_data`, as `trainer.training.startup` reads it), the planner
builds the run's model whole with the run's seed (`trainer.model.family.build_model`, the
weights every rank's shard is cut from), runs each data-parallel rank's microbatches of the step
(`trainer.data.sources.make_batches`: the run's batch plan and seed; step 1, the first, unless
asked for others) forward, and at every MoE layer asks the layer's own router (`MoE.route`:
top-k and capacity over the microbatch's tokens, as the run routes them) which member of the
rank's ep group holds each kept assignment's expert (dp rank d is member ``d % ep``; member p
holds experts ``p*L .. p*L+L-1``: `trainer.comm.topology`, `trainer.parallel.expert.dispatch`).
A rank sends its rows for the other members (dispatch) and the outputs of the rows it got from
them (combine), and backward the same again; the busiest rank's rows per token, halved (one way
of the pair, as the balanced share counts), is the answer.

Only with ``--plan-routing`` (it builds the whole model once more, on rank 0 at a run's
start-up: seconds of CPU and the model's memory for a large one). Fallback, the balanced
routing's ``topk * min(1, capacity_factor) * (ep - 1) / ep``, when: it is off, the data cannot
be read here (the planner run away from the run's data), the whole model would
take more than `trainer.plan.shapes.MOE_REAL_BYTES`, or under context parallelism (a cp rank
routes its share of each sequence, whose capacity the whole-sequence forward does not have).
The routing is the initial weights' (the run's first step; later steps' routers move a
little), without dropout and in fp32 (bf16 activations may route a little differently).
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

import torch

from trainer.config.options import TrainConfig
from trainer.errors import TrainerError

if TYPE_CHECKING:
    from trainer.data.batches import ShardedBatches
    from trainer.data.token_batches import TokenBatches
    from trainer.parallel.expert.layer import MoE


def balanced_share(cfg: TrainConfig) -> float:
    """Rows sent to other ep members per token and MoE layer, routing balanced."""
    moe, ep = cfg.gpt.moe, cfg.parallel.ep
    kept = min(1.0, moe.capacity_factor) if moe.capacity_factor > 0 else 1.0
    return moe.topk * kept * (ep - 1) / ep if ep > 1 else 0.0


def sent_share(cfg: TrainConfig, steps: tuple[int, ...] = (1,)) -> float:
    """The busiest rank's all-to-all rows per token and MoE layer, one way (module docstring):
    measured on the run's ``steps`` (the first, by default), or the balanced share."""
    measured = measured_share(cfg, steps)
    return balanced_share(cfg) if measured is None else measured


@cache
def measured_share(cfg: TrainConfig, steps: tuple[int, ...] = (1,)) -> float | None:
    """The routed share measured on the run's ``steps``, None where it is not measured
    (module docstring). Dispatch sends a rank's rows for the other members' experts, the
    combine sends back the rows it got from them, and backward does both again: per rank the
    rows it sends plus the rows it receives, twice; the share is half of that per token."""
    if cfg.parallel.ep <= 1 or not cfg.gpt.moe.experts:
        return 0.0
    routed = _routed(cfg, steps)
    if routed is None:
        return None
    ep, dp, shares = cfg.parallel.ep, cfg.parallel.dp, []
    for rows, tokens in routed:
        moved = [sum(rows[d]) - rows[d][d % ep]  # sent to the others
                 + sum(rows[q][d % ep] for q in range(d - d % ep, d - d % ep + ep) if q != d)
                 for d in range(dp)]
        shares.append([m / (2 * tokens[d]) if tokens[d] else 0.0 for d, m in enumerate(moved)])
    return max(sum(per_step[d] for per_step in shares) / len(steps) for d in range(dp))


@cache
def measured_rows(cfg: TrainConfig, steps: tuple[int, ...] = (1,)) -> float | None:
    """The most rows one rank's experts run per MoE layer and microbatch in the run's
    ``steps`` (the rows its ep group's members route to its experts; mean over the layers and
    microbatches of a step, the busiest rank and step kept), None where it is not measured
    (module docstring): what the experts' activations grow with."""
    if not cfg.gpt.moe.experts:
        return 0.0
    routed = _routed(cfg, steps)
    if routed is None:
        return None
    par, gpt = cfg.parallel, cfg.gpt
    ep, per_rank = par.ep, par.microbatches * len(range(0, gpt.n_layer, gpt.moe.every))
    return max(sum(rows[q][d % ep] for q in range(d - d % ep, d - d % ep + ep)) / per_rank
               for rows, _ in routed for d in range(par.dp))


@cache
def _routed(cfg: TrainConfig, steps: tuple[int, ...]
            ) -> tuple[tuple[tuple[tuple[int, ...], ...], tuple[int, ...]], ...] | None:
    """Per step of ``steps``: rows[d][p], the kept rows dp rank d routes to member p of its
    ep group, and the tokens each dp rank routed (summed over its microbatches and the MoE
    layers); None where the run cannot be routed here (module docstring)."""
    from trainer.plan.shapes import MOE_REAL_BYTES, stage_params

    par, gpt = cfg.parallel, cfg.gpt
    if par.cp > 1 or not cfg.logging.plan_routing:
        return None
    params = sum(s.dense + s.expert for s in stage_params(gpt, tp=1, pp=1))
    if 4 * params > MOE_REAL_BYTES:
        return None
    try:
        data = training_batches(cfg)
    except (TrainerError, OSError):
        return None  # no data here: the balanced share
    from trainer.model.family import build_model

    # The run's model, whole, with the run's seed, without dropout; dropped when done (not
    # cached: the trainer plans its own run with it before training).
    model = build_model(gpt, seed=cfg.seed).eval()
    out = []
    for step in steps:
        rows, routed = zip(*(_rows_to_members(model, cfg, [m[0] for m in b.microbatches(step)])
                             for b in data), strict=True)
        out.append((tuple(tuple(r) for r in rows), tuple(routed)))
    return tuple(out)


def training_batches(cfg: TrainConfig) -> list[ShardedBatches | TokenBatches]:
    """Each data-parallel rank's batches, as the run makes them."""
    from trainer.data.batches import BatchPlan
    from trainer.data.sources import make_batches, read_data

    # as `trainer.training.startup.training_data` reads the run's (which trainer.plan, imported
    # by trainer.training, cannot import)
    data = read_data(cfg.data.path, vocab_size=cfg.gpt.vocab_size, seq_len=cfg.gpt.seq_len,
                     val_fraction=cfg.data.val_fraction, documents=cfg.data.document_mask,
                     cap_mb=cfg.data.data_cap_mb, validation=cfg.logging.eval_every > 0)
    plan = BatchPlan(cfg.data.global_batch, cfg.parallel.dp, cfg.parallel.microbatches)
    return [make_batches(data, seq_len=cfg.gpt.seq_len, plan=plan, seed=cfg.seed,
                         dp_rank=dp_rank, device=torch.device("cpu"), reporter=False)
            for dp_rank in range(cfg.parallel.dp)]


def _rows_to_members(model: torch.nn.Module, cfg: TrainConfig,
                     microbatches: list[torch.Tensor]) -> tuple[list[int], int]:
    """The kept rows a dp rank's ``microbatches`` route to each member of its ep group, summed
    over the MoE layers, and the tokens they routed (summed alike)."""
    from trainer.parallel.expert.layer import moe_layers

    ep, local = cfg.parallel.ep, cfg.gpt.moe.experts // cfg.parallel.ep
    to_member, routed = [0] * ep, 0

    def count(module: MoE, args: tuple[torch.Tensor, ...]) -> None:
        nonlocal routed
        x_BTD = args[0]
        routing = module.route(x_BTD.reshape(-1, x_BTD.shape[-1]))
        member = routing.experts[routing.kept] // local
        for p, n in enumerate(torch.bincount(member, minlength=ep).tolist()):
            to_member[p] += n
        routed += routing.experts.shape[0]

    hooks = [layer.register_forward_pre_hook(count) for _, layer in moe_layers(model)]
    try:
        with torch.no_grad():
            for idx in microbatches:
                model(idx)
    finally:
        for hook in hooks:
            hook.remove()
    return to_member, routed

