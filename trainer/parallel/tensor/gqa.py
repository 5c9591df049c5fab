"""Tensor parallelism of the Llama block (`trainer.model.llama`): grouped-query attention and
the SwiGLU MLP, on the Megatron layers of `trainer.parallel.tensor.layers`.

    attn.q     ColumnParallelLinear: rank r computes query heads r·H/tp .. (r+1)·H/tp
    attn.kv    G >= tp: ColumnParallelLinear, stride 2 ([k; v]): key and value heads
               r·G/tp .. (r+1)·G/tp, exactly the groups of the rank's query heads;
               G < tp: `ReplicatedKVLinear` (every rank holds the whole [k; v] and computes the
               one group its query heads read)
    attn.proj  RowParallelLinear
    mlp.fc     ColumnParallelLinear, stride 2 ([gate; up]): each rank its slice of both
    mlp.proj   RowParallelLinear

With fewer key/value heads than ranks each group is needed on tp/G ranks. Megatron-LM keeps
such a group whole on every rank that needs it; here the fused weight stays replicated (a
plain replica: checkpoints and ZeRO see an ordinary replicated parameter) and each rank slices
out its group's rows. The slice is taken from the weight through ``copy_to_region``, whose
backward sums the weight's gradient over the TP group: a group's gradient is the sum of what
its tp/G ranks contributed, and the other groups' rows receive zeros from the ranks that did not
use them, so every rank ends with the serial model's whole gradient. The input enters as in a
column layer (``copy_to_region``, or the sequence all-gather under sequence parallelism), so its
gradient is summed too.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from trainer.comm.protocol import Communicator
from trainer.model.config import GPTConfig
from trainer.model.layers import Block
from trainer.model.llama import GQAttention, SwiGLU
from trainer.parallel.tensor import mappings as m
from trainer.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from trainer.parallel.tensor.sharding import TensorParallelError


def check_heads(cfg: GPTConfig, tp: int) -> None:
    """Refuse key/value heads that neither split over nor evenly share ``tp`` ranks."""
    g = cfg.kv_heads
    if (g >= tp and g % tp) or (g < tp and tp % g):
        raise TensorParallelError(
            "key/value heads do not fit the tensor-parallel group", f"--tp {tp}",
            f"n_kv_head = {g} must be a multiple of tp (each rank its own heads) or divide it "
            "(each head replicated on tp / n_kv_head ranks)",
            f"Choose a tp that divides or is a multiple of {g}")


class ReplicatedKVLinear(nn.Module):
    """The fused key/value projection, replicated over TP, computing one group per rank."""

    def __init__(self, weight: torch.Tensor, comm: Communicator, *, groups: int,
                 head_dim: int, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.weight = nn.Parameter(weight.detach() if weight.is_meta else
                                   weight.detach().clone())
        group = comm.rank * groups // comm.size
        k = group * head_dim
        self.rows = ((k, k + head_dim), (groups * head_dim + k, groups * head_dim + k + head_dim))
        """The rows of this rank's group: its key head, then its value head."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = m.copy_to_region(self.weight, self.comm)  # backward: the gradient summed over TP
        w = torch.cat([w[a:b] for a, b in self.rows])
        if self.sequence_parallel:
            return m.linear_on_gathered_sequence(x, w, None, self.comm)
        return F.linear(m.copy_to_region(x, self.comm), w)

    def extra_repr(self) -> str:
        return (f"rows={self.rows} of {tuple(self.weight.shape)} (replicated over "
                f"{self.comm.size} ranks), sequence_parallel={self.sequence_parallel}")


def shard_attention(attn: GQAttention, cfg: GPTConfig, tp: Communicator, where: str) -> None:
    """Split one grouped-query attention over ``tp``, in place."""
    # The model declares nn.Linear for what TP swaps for a sharded layer of the same call
    # signature: each swap is an ignore[assignment] (as in `shard_swiglu`).
    attn.q = ColumnParallelLinear.from_linear(attn.q, tp, name=f"{where}.q")  # type: ignore[assignment]  # sharded swap
    if cfg.kv_heads >= tp.size:
        attn.kv = ColumnParallelLinear.from_linear(attn.kv, tp, stride=2, name=f"{where}.kv")  # type: ignore[assignment]  # sharded swap
    else:
        attn.kv = ReplicatedKVLinear(attn.kv.weight, tp, groups=cfg.kv_heads,  # type: ignore[assignment]  # sharded swap
                                     head_dim=cfg.head_dim)
    attn.proj = RowParallelLinear.from_linear(attn.proj, tp, name=f"{where}.proj")  # type: ignore[assignment]  # sharded swap


def shard_swiglu(mlp: SwiGLU, tp: Communicator, where: str) -> None:
    """Split one SwiGLU MLP over ``tp``, in place ([gate; up] with stride 2)."""
    mlp.fc = ColumnParallelLinear.from_linear(mlp.fc, tp, stride=mlp.fc_stride,  # type: ignore[assignment]  # sharded swap
                                              name=f"{where}.fc")
    mlp.proj = RowParallelLinear.from_linear(mlp.proj, tp, name=f"{where}.proj")  # type: ignore[assignment]  # sharded swap


def shard_llama_block(block: Block, cfg: GPTConfig, tp: Communicator,
                      where: str) -> None:
    """Split a Llama block's attention and (dense) MLP over ``tp``, in place."""
    shard_attention(cast(GQAttention, block.attn), cfg, tp, f"{where}.attn")
    if isinstance(block.mlp, SwiGLU):  # MoE layers split their experts themselves
        shard_swiglu(block.mlp, tp, f"{where}.mlp")
