"""One rank of the MoE tests; returns what it saw (`tests.support.mpi_runs`).

    mpiexec -n 4 python -m tests.support.mpi_worker tests.support.moe_workers.worker:run OUT

First it probes dispatch and combine over an EP group of the whole world: the round trip with
weights of 1 is the identity even when every token goes to one expert (so three members receive
nothing), and the layer's outputs and gradients under that forced imbalance equal the plain
loop's. Then it trains every case of `tests.support.moe_workers.cases` at every layout with the
trainer's own ``build_run``/``train_step`` in fp64.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.moe_reference import chain_terms, magnitudes, reference_moe
from tests.support.moe_workers.cases import CASES, LAYOUTS, STEPS, case_config
from tests.support.numerics import float64
from trainer.comm.bootstrap import World, init
from trainer.comm.protocol import Communicator, ReduceOp
from trainer.config.options import resolve_dp
from trainer.model.config import GPTConfig, MoEConfig
from trainer.model.gpt import GPT
from trainer.parallel.expert.dispatch import combine, dispatch
from trainer.parallel.expert.layer import MoE
from trainer.parallel.expert.router import Routing
from trainer.parallel.tensor.sharding import shard_spec
from trainer.training.run import build_run, mesh_for
from trainer.training.step import train_step

D = 8


def round_trip(ep: Communicator, experts_of: torch.Tensor) -> bool:
    """combine(dispatch(x)) == x, bit for bit, for top-1 routing with weights of 1."""
    n, n_experts = experts_of.shape[0], 2 * ep.size
    x = torch.randn(n, D, generator=torch.Generator().manual_seed(ep.rank))
    routing = Routing(experts_of[:, None], torch.ones(n, 1), torch.ones(n, 1, dtype=torch.bool),
                      torch.zeros(()), torch.bincount(experts_of, minlength=n_experts))
    rows, plan = dispatch(x, routing, n_experts, ep)
    return torch.equal(combine(rows, plan, n), x)


def imbalance_probe(ep: Communicator) -> dict[str, Any]:
    """Every token of every rank goes to expert 0 (on member 0): outputs, input gradients and
    the summed expert gradients equal the plain loop's."""
    cfg = GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8,
                    moe=MoEConfig(experts=2 * ep.size, topk=1, z_loss_coeff=1e-3))
    torch.manual_seed(0)
    layer = MoE(cfg, GPT.make_mlp)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 50.0
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(10 + ep.rank))
    x[..., 0] = x[..., 0].abs() + 1
    ref_x = x.clone().requires_grad_()
    ref_out, ref_aux = reference_moe(layer, ref_x)
    (ref_out.square().sum() + ref_aux).backward()
    ref_expert0 = [p.grad.clone() for p in layer.experts["0"].parameters()]
    ref_router = layer.router.weight.grad.clone()
    layer.zero_grad()
    # Magnitudes for the loss out² + aux: its upstream 2·out carries out's own rounding, so
    # the chain runs on 2·|out|'s magnitude.
    out_mag = magnitudes(layer, x, torch.zeros_like(x))["out"]
    mag = magnitudes(layer, x, 2 * out_mag)
    mag_expert0 = [mag[f"experts.0.{n}"] for n, _ in layer.experts["0"].named_parameters()]
    for p in [*ref_expert0, *mag_expert0]:  # the EP expert sees every rank's tokens: sum them
        ep.all_reduce(p, ReduceOp.SUM)
    terms = chain_terms(layer, x.shape[0] * x.shape[1] * ep.size)
    layer.shard(ep)
    x.requires_grad_()
    out = layer(x)
    out.square().sum().backward()
    return {"out": out.detach(), "ref_out": ref_out.detach(), "grad": x.grad,
            "ref_grad": ref_x.grad, "router": layer.router.weight.grad, "ref_router": ref_router,
            "expert0": [p.grad for p in layer.experts["0"].parameters()] if ep.rank == 0 else [],
            "ref_expert0": ref_expert0, "ep_scale": 1.0 / ep.size,
            "mag": {"out": mag["out"], "grad": mag["x"], "router": mag["router.weight"],
                    "expert0": mag_expert0},
            "terms": terms}


def train_layout(case: str, layout: str, world: World, out: Path) -> dict[str, Any]:
    cfg = resolve_dp(case_config(case, layout).with_options(run_dir=str(out / case / layout)),
                     world.size)
    mesh = mesh_for(cfg, world)
    run = build_run(cfg, mesh)
    records = [train_step(run, step) for step in range(1, STEPS + 1)]
    return {"tp_rank": mesh.rank("tp"), "losses": [r.loss for r in records],
            "norms": [r.grad_norm for r in records],
            "params": {n: p.detach().clone() for n, p in run.model.named_parameters()},
            "specs": {n: shard_spec(p) for n, p in run.model.named_parameters()},
            "moe": [r.moe for r in records]}


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    ep = world.comm
    everything_to_0 = torch.zeros(12, dtype=torch.int64)
    spread = torch.randint(0, 2 * ep.size, (12,), generator=torch.Generator().manual_seed(3))
    nothing_from_me = spread if ep.rank else torch.zeros(0, dtype=torch.int64)
    result: dict[str, Any] = {
        "round_trip": {"all_to_expert_0": round_trip(ep, everything_to_0),
                       "spread": round_trip(ep, spread),
                       "rank_0_sends_nothing": round_trip(ep, nothing_from_me)}}
    with float64():
        result["imbalance"] = imbalance_probe(ep)
        for case in CASES:
            for layout in LAYOUTS:
                result[f"{case}/{layout}"] = train_layout(case, layout, world, out)
    return result
