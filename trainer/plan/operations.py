"""What one rank's step runs, counted on the trainer's own model: tensor operations, their
matrix-product FLOPs and the bytes the other operations move, and the message steps of its
tensor- and context-parallel collectives (the planner's step time, `trainer.plan.estimate`).

The rank's model of one and of two blocks (`trainer.plan.shapes.rank_model`: fake tensors, set
up as the run sets it up) runs forward, loss and backward under a dispatch mode that sees every
ATen operation autograd and the model issue: recomputation's second forward, sequence
parallelism's gathers and the attention core as the run executes them. A block's count is the
difference of the two, the rest (embedding, final norm, head, loss) what is left of one.

* operations: every ATen call (views too: each costs the host a dispatch; counted alike on
  fake and real tensors: tiny's forward and backward, 266 both);
* FLOPs: of the matrix products and attention, by torch's own per-operation formulas
  (`torch.utils.flop_counter`'s registry);
* bytes: inputs read plus outputs written by every other operation that is not a view (the
  element-wise operations, norms, softmax, copies: bound by memory bandwidth, not FLOP/s);
* message steps: the ring steps of the collectives the model's tp and cp communicators were
  asked for (`trainer.plan.shapes.ShapeComm.steps`).

Not counted: the optimizer step and the gradient synchronisation's own operations (a few per
parameter tensor, against hundreds per block).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainer.config.options import TrainConfig
from trainer.model.config import GPTConfig
from trainer.plan.shapes import RankModel, rank_model


@dataclass(frozen=True)
class Work:
    """One microbatch's forward and backward on one rank, or a part of it."""

    ops: int
    flops: float
    bytes: float
    """Bytes read and written by the operations that are not matrix products or views."""
    tp_steps: int
    """Message steps of the tensor-parallel collectives."""
    cp_steps: int
    """Message steps of the context-parallel exchange."""

    def __add__(self, other: Work) -> Work:
        return Work(self.ops + other.ops, self.flops + other.flops, self.bytes + other.bytes,
                    self.tp_steps + other.tp_steps, self.cp_steps + other.cp_steps)

    def __sub__(self, other: Work) -> Work:
        return self + other.times(-1)

    def times(self, k: float) -> Work:
        return Work(round(self.ops * k), self.flops * k, self.bytes * k,
                    round(self.tp_steps * k), round(self.cp_steps * k))


class _Counter(TorchDispatchMode):
    """Counts every ATen call beneath it, and what `Work` counts of it."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's
        self.ops, self.flops, self.bytes = 0, 0.0, 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.prim.device.default:  # the fake mode's own query, not the run's
            return out
        self.ops += 1
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        elif "scaled_dot_product" in func.__name__:  # the CPU's fused attention, not listed
            backward = "backward" in func.__name__  # (grad_out, query, key, ...)
            tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
            q, k = tensors[int(backward):int(backward) + 2]
            # QK^T and PV: 4 q.numel() x key length forward, twice that backward
            self.flops += (8 if backward else 4) * q.numel() * k.shape[-2]
        elif not func.is_view:
            self.bytes += sum(t.nbytes for t in tree_flatten((args, kwargs, out))[0]
                              if isinstance(t, torch.Tensor))
        return out


def _count(cfg: GPTConfig, how: RankModel) -> Work:
    with rank_model(cfg, how) as (model, idx, comms):
        counter = _Counter()
        with counter:
            model.loss(idx, idx).backward()
        return Work(counter.ops, counter.flops, counter.bytes, comms[0].steps, comms[1].steps)


@dataclass(frozen=True)
class Operations:
    """One microbatch's work on one rank: per block, and the rest."""

    per_block: Work
    rest: Work


@cache
def operations(cfg: GPTConfig, how: RankModel) -> Operations:
    """The work of ``cfg``'s blocks and of the rest on a rank set up as ``how`` (module
    docstring)."""
    one, two = (_count(replace(cfg, n_layer=layers), how) for layers in (1, 2))
    return Operations(per_block=two - one, rest=one - (two - one))


def rank_step(cfg: TrainConfig, *, bf16: bool) -> Work:
    """The busiest rank's work in one step: every microbatch's forward and backward of the
    layers it holds (its pipeline stages' together), and of the rest."""
    from trainer.plan.shapes import check_measurable

    par, gpt = cfg.parallel, cfg.gpt
    check_measurable(gpt)
    # Counted on one sequence (the layouts of a plan share it whatever their microbatch): as
    # many operations and message steps per microbatch, FLOPs and bytes times its sequences
    # (the FLOPs exactly; the bytes but for the weights' share, which does not grow).
    how = RankModel(par.tp, par.sequence_parallel, par.recompute, 1,
                    "bf16" if bf16 else "fp32", par.cp, par.cp_comm)
    work = operations(gpt, how)
    counts = cfg.stage_layers
    layers = max(sum(counts[r::par.pp]) for r in range(par.pp)) if par.pp > 1 else gpt.n_layer
    one = work.per_block.times(layers) + work.rest
    mb = cfg.micro_batch
    return replace(one, flops=one.flops * mb, bytes=one.bytes * mb).times(par.microbatches)


def op_seconds(chain: int = 2000, repeats: int = 5) -> float:
    """Host seconds per tensor operation on this CPU, measured: a chain of ``chain``
    multiplications of one-element tensors, forward and backward under autograd (the best of
    ``repeats``), over the ATen operations it issues (counted as `operations` counts)."""
    import time

    x = torch.ones(1, requires_grad=True)

    def run() -> None:
        y = x
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()

    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    counter = _Counter()
    with counter:
        run()
    return best / counter.ops
