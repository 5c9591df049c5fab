"""Expert parallelism: expert sharding over the mesh's ep axis, gradient reduction, norms.

Groups (Megatron's order, `trainer.comm.topology`): the DP ranks of one (tp, pp) position are
cut into blocks of ``ep`` adjacent DP ranks, each block an EP group that splits every MoE
layer's experts among its members; the DP ranks holding the same experts (same index in their
EP block) form the expert-data-parallel (EDP) group of dp/ep ranks. With dp = 4, ep = 2: EP
groups of DP ranks {0,1}, {2,3}; EDP groups {0,2}, {1,3}. The mesh splits both.

Gradients: dense parameters are averaged over the whole DP group as before. An expert on EP
member q of group g processed the tokens of every member of g, so its local gradient already
sums those ranks' contributions; the serial model's gradient (the mean over all dp ranks' losses)
is then the EDP sum times 1/dp (Megatron's ``expert_gradient_scaling_factor``). The expert
parameters carry a hook that multiplies their gradient by 1/ep before it is accumulated, and
their own `DataParallel` on the EDP group averages (1/(dp/ep)): 1/dp in all.

With TP > 1 every TP rank holds the same tokens (there is no sequence parallelism) and so routes
them identically; each expert MLP is split over TP like a dense one (fc by columns, proj by
rows, one all-reduce per expert), so no extra all-gather or reduce-scatter over TP is needed.
The router is replicated over TP like the norms.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from trainer.comm.mesh import Mesh
from trainer.comm.protocol import Communicator
from trainer.data_parallel.grad_sync import DataParallel
from trainer.moe.layer import moe_layers, set_aux_scale
from trainer.optim.grad_clip import NormScope
from trainer.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


def shard_experts(model: nn.Module, ep: Communicator, tp: Communicator | None = None) -> None:
    """Keep this EP member's block of experts in every MoE layer (the others are deleted, so
    the remaining names carry global expert indices) and split them over ``tp``."""
    for name, layer in moe_layers(model):
        local = layer.n_experts // ep.size
        mine = range(ep.rank * local, (ep.rank + 1) * local)
        for key in [k for k in layer.experts if int(k) not in mine]:
            del layer.experts[key]
        layer.ep = ep
        if tp is not None and tp.size > 1:
            for key, mlp in layer.experts.items():
                where = f"{name}.experts.{key}"
                mlp.fc = ColumnParallelLinear.from_linear(mlp.fc, tp, stride=mlp.fc_stride,
                                                          name=f"{where}.fc")
                mlp.proj = RowParallelLinear.from_linear(mlp.proj, tp, name=f"{where}.proj")
        if ep.size > 1:
            for p in layer.experts.parameters():
                p.register_hook(lambda g, s=1.0 / ep.size: g * s)


def is_expert(name: str) -> bool:
    return ".experts." in name


@dataclass(frozen=True)
class ParamSubset:
    """The part of a model one `DataParallel` synchronises (it reads only these three)."""

    named: Sequence[tuple[str, nn.Parameter]]
    buffer_list: Sequence[torch.Tensor] = ()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self.named)

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named)

    def buffers(self) -> Iterator[torch.Tensor]:
        return iter(self.buffer_list)


class ExpertDataParallel:
    """Two `DataParallel`s behind the one interface the training step uses: dense parameters
    over DP, expert parameters over EDP."""

    def __init__(self, dense: DataParallel, experts: DataParallel) -> None:
        self.dense, self.experts = dense, experts

    @classmethod
    def build(cls, model: nn.Module, dp: Communicator, edp: Communicator,
              **options: object) -> ExpertDataParallel:
        named = list(model.named_parameters())
        dense = ParamSubset([(n, p) for n, p in named if not is_expert(n)],
                            list(model.buffers()))
        experts = ParamSubset([(n, p) for n, p in named if is_expert(n)])
        return cls(DataParallel(dense, dp, **options), DataParallel(experts, edp, **options))

    @property
    def comm(self) -> Communicator:
        return self.dense.comm

    @property
    def buffer(self) -> torch.Tensor:
        return self.dense.buffer

    @property
    def params(self) -> list[nn.Parameter]:
        return self.dense.params + self.experts.params

    @property
    def buckets(self) -> list:
        return self.dense.buckets + self.experts.buckets

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(self.dense.no_sync())
            stack.enter_context(self.experts.no_sync())
            yield

    def zero_grad(self) -> None:
        self.dense.zero_grad()
        self.experts.zero_grad()

    def finish_grad_sync(self) -> None:
        self.dense.finish_grad_sync()
        self.experts.finish_grad_sync()


def ep_scope(scope: NormScope, ep: Communicator, model: nn.Module) -> NormScope:
    """``scope`` extended over EP: experts count on every member (each holds others), the
    dense parameters on EP member 0 only (every member holds the same)."""
    if ep.size == 1:
        return scope
    experts = {id(p) for n, p in model.named_parameters() if is_expert(n)}
    leader = ep.rank == 0
    return scope.along(ep, lambda p: leader or id(p) in experts)


def apply_expert_parallel(model: nn.Module, mesh: Mesh, *, microbatches: int) -> bool:
    """Weigh the auxiliary losses for ``microbatches`` per step and, when the model has MoE
    layers, split its experts over the mesh's EP and TP groups. Whether it has MoE layers."""
    if not moe_layers(model):
        return False
    set_aux_scale(model, microbatches)
    shard_experts(model, mesh.group("ep"), mesh.group("tp"))
    return True
