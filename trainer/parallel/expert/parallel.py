"""Expert parallelism: expert sharding over the mesh's ep axis, and the gradient reduction.

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

Nothing outside this package names the EP axes for that: each expert parameter says on itself
which DP axes its copies span (``param.dp_replicas = ("cp", "edp")``), and the run groups its
gradient reductions (`trainer.parallel.data.split`), its checkpoint replicas and its norm by
the parameters' placements (`trainer.placement.parameters`). The MoE layer splits itself when
the run places the model on the mesh (`MoE.place_on`).

With TP > 1 every TP rank holds the same tokens (there is no sequence parallelism) and so routes
them identically; each expert MLP is split over TP like a dense one (fc by columns, proj by
rows, one all-reduce per expert), so no extra all-gather or reduce-scatter over TP is needed.
The router is replicated over TP like the norms.
"""

from __future__ import annotations

from typing import cast

from torch import nn

from trainer.comm.protocol import Communicator
from trainer.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

EXPERT_REPLICAS = ("cp", "edp")
"""The axes an expert's copies span: the ranks at its place in every EP block, on every cp
rank (context parallelism splits tokens, not weights)."""


def shard_layer(name: str, experts: nn.ModuleDict, ep: Communicator,
                tp: Communicator | None = None) -> None:
    """Keep this EP member's block of ``experts`` (keyed by global index; the others are
    deleted, so the remaining names carry global expert indices), split them over ``tp``, and
    mark their parameters as replicated over expert-DP only. ``name``: the layer's, for the
    TP layers' messages."""
    local = len(experts) // ep.size
    mine = range(ep.rank * local, (ep.rank + 1) * local)
    for key in [k for k in experts if int(k) not in mine]:
        del experts[key]
    if tp is not None and tp.size > 1:
        for key, mlp in experts.items():  # dense MLPs (`trainer.model.family.DENSE_MLPS`)
            where = f"{name}.experts.{key}"
            mlp.fc = ColumnParallelLinear.from_linear(cast(nn.Linear, mlp.fc), tp,
                                                      stride=cast(int, mlp.fc_stride),
                                                      name=f"{where}.fc")
            mlp.proj = RowParallelLinear.from_linear(cast(nn.Linear, mlp.proj), tp,
                                                     name=f"{where}.proj")
    for p in experts.parameters():
        p.dp_replicas = EXPERT_REPLICAS  # type: ignore[attr-defined]  # read by data.split
        if ep.size > 1:
            p.register_hook(lambda g, s=1.0 / ep.size: g * s)
