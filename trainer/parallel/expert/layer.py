"""The mixture-of-experts layer that replaces the MLP of every ``moe_every``-th block.

    router    nn.Linear(D, E, bias=False), run in at least fp32 (`trainer.parallel.expert.router`)
    experts   nn.ModuleDict of the family's dense MLPs (`trainer.model.gpt.GPT.make_mlp`) keyed by
              the *global* expert index

Keying the experts by global index is the pipeline's trick for layers: expert parallelism
(`trainer.parallel.expert.parallel`) deletes the experts a rank does not hold, and the names that
remain
(``blocks.0.mlp.experts.5.fc.weight``) say which expert a checkpoint shard holds. Experts run as
a loop over the local experts, each on its contiguous chunk of dispatched rows (a grouped GEMM
needs a CUDA kernel torch does not offer for every dtype; on CPU the loop is the fast path).

The auxiliary loss (load balancing plus z-loss) is not added to the language-model loss the
trainer logs: like Megatron's ``MoEAuxLossAutoScaler`` it rides on the layer's output and enters
the gradient in backward with the weight ``aux_scale`` (1 / microbatches of the step, the factor
the language-model loss is divided by), so it needs no path of its own through a pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd import Function

from trainer.comm.mesh import Mesh
from trainer.comm.protocol import Communicator
from trainer.model.config import GPTConfig
from trainer.parallel.expert.dispatch import combine, dispatch
from trainer.parallel.expert.parallel import shard_layer
from trainer.parallel.expert.router import Routing, route


class MoE(nn.Module):
    """Router, top-k dispatch to the experts and the weighted combine of their outputs."""

    def __init__(self, cfg: GPTConfig, make_mlp: Callable[[GPTConfig], nn.Module]) -> None:
        super().__init__()
        self.n_experts, self.topk = cfg.moe.experts, cfg.moe.topk
        self.score, self.capacity_factor = cfg.moe.router, cfg.moe.capacity_factor
        self.aux_coeff, self.z_coeff = cfg.moe.aux_loss_coeff, cfg.moe.z_loss_coeff
        self.router = nn.Linear(cfg.d_model, cfg.moe.experts, bias=False)
        self.experts = nn.ModuleDict({str(e): make_mlp(cfg) for e in range(cfg.moe.experts)})
        self.ep: Communicator | None = None
        """The expert-parallel group the experts are split over (None: all are here)."""
        self.aux_scale = 1.0
        """The weight of the auxiliary loss in backward (1 / microbatches per step)."""
        self.load = torch.zeros(cfg.moe.experts + 3, dtype=torch.float64)
        """Training forwards since `take_load`: assignments per expert (before dropping),
        dropped assignments, the auxiliary loss summed, the number of forwards."""

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        routing = self.route(x_ND)
        rows, plan = dispatch(x_ND, routing, self.n_experts, self.ep)
        chunks = rows.split(plan.local_counts)
        outs = [expert(chunk) for expert, chunk in zip(self.experts.values(), chunks, strict=True)]
        y_ND = combine(torch.cat(outs) if outs else rows, plan, x_ND.shape[0]).to(x_BTD.dtype)
        if self.training:  # tensor ops only: no device sync in the forward
            self.load = self.load.to(x_BTD.device) + torch.cat([
                routing.routed.double(), (~routing.kept).sum().double().reshape(1),
                routing.aux_loss.detach().double().reshape(1), self.load.new_ones(1)])
        y_BTD = y_ND.view_as(x_BTD)
        if torch.is_grad_enabled() and routing.aux_loss.requires_grad:
            y_BTD = _AuxLoss.apply(y_BTD, routing.aux_loss * self.aux_scale)  # type: ignore[no-untyped-call]  # torch's Function.apply
        return y_BTD

    def place_on(self, name: str, mesh: Mesh) -> None:
        """Split the experts over the mesh's EP group, each over its TP group (the run places
        every module that can, `trainer.placement.parameters.place_parameters`)."""
        self.shard(mesh.group("ep"), mesh.group("tp"), name=name)

    def shard(self, ep: Communicator, tp: Communicator | None = None, *, name: str = "") -> None:
        """Keep this member of ``ep``'s block of experts, split over ``tp``
        (`trainer.parallel.expert.parallel`)."""
        shard_layer(name, self.experts, ep, tp)
        self.ep = ep

    def take_load(self) -> torch.Tensor:
        """The load counted since the last call (see ``load``), and start counting anew."""
        load, self.load = self.load, torch.zeros_like(self.load)
        return load

    def route(self, x_ND: torch.Tensor) -> Routing:
        return route(x_ND, self.router.weight, topk=self.topk, score=self.score,
                     aux_coeff=self.aux_coeff, z_coeff=self.z_coeff,
                     capacity_factor=self.capacity_factor)


class _AuxLoss(Function):
    """Identity on the output; backward also gives the auxiliary loss a gradient of 1."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux.shape
        ctx.aux_dtype = aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


def is_moe_layer(index: int, cfg: GPTConfig) -> bool:
    """Megatron's ``moe_layer_freq``: layers 0, n, 2n, ... are MoE layers."""
    return cfg.moe.experts > 0 and index % cfg.moe.every == 0


def install_moe(blocks: nn.ModuleDict, cfg: GPTConfig,
                make_mlp: Callable[[GPTConfig], nn.Module]) -> None:
    """Replace the MLP of every MoE layer of ``blocks`` (keyed by global layer index) by a
    mixture of ``make_mlp``'s dense MLPs (the model family's: `GPT.make_mlp`)."""
    for key, block in blocks.items():
        if is_moe_layer(int(key), cfg):
            block.mlp = MoE(cfg, make_mlp)


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """(name, layer) of every MoE layer of ``model``, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def set_aux_scale(model: nn.Module, microbatches: int) -> None:
    """Weigh the auxiliary losses as the trainer weighs the language-model loss."""
    for _, layer in moe_layers(model):
        layer.aux_scale = 1.0 / microbatches
