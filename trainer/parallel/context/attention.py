"""Context-parallel causal attention behind one call: ``attend(q, k, v) -> out``.

`ContextParallelAttention` takes this rank's queries, keys and values (B, heads, T_local, K)
for the tokens `SequenceLayout` gives it, already rotated at their global positions, and
returns its rows of causal softmax(QKᵀ·scale)·V over the whole sequence, differentiable. The
call has the shape of the models' attention ``core(q, k, v)`` (`trainer.model.layers`), which
is where the trainer will plug it in. Two exchanges compute the same result:

* ``ring`` (`trainer.parallel.context.ring`): K/V hop around the group, each hop overlapped
  with a block's computation; a rank never holds more than two ranks' K/V.
* ``allgather`` (`trainer.parallel.context.allgather`): one all-gather of K/V per layer, as
  Llama 3 trained.

Dropout of the attention probabilities is refused for now. A rank computes its probabilities
block by block, in an order that depends on cp, so a dropout mask drawn from a generator in
computation order would differ between cp sizes and from the serial model. Dropout here needs a
mask that is a function of (seed, layer, sample, head, global query, global key) alone: a
counter-based generator (Philox) indexed by global positions, as fused attention kernels key
their dropout by offset. Until then `check_dropout` refuses it, at build time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from trainer.comm.protocol import Communicator
from trainer.parallel.context.allgather import AllGatherAttention
from trainer.parallel.context.documents import check_documents
from trainer.parallel.context.layout import ContextParallelError, SequenceLayout
from trainer.parallel.context.ring import RingAttention

Exchange = Literal["ring", "allgather"]
EXCHANGES: tuple[Exchange, ...] = ("ring", "allgather")


def check_dropout(dropout_p: float, where: str = "dropout") -> None:
    """Refuse attention-probability dropout under context parallelism (see the module)."""
    if dropout_p != 0.0:
        raise ContextParallelError(
            "attention dropout is not supported with context parallelism", where,
            f"dropout {dropout_p} would draw a different mask per cp layout, since each rank "
            "computes its attention probabilities block by block",
            "Set dropout to 0 when cp is above 1, or train without context parallelism")


@dataclass(frozen=True)
class ContextParallelAttention:
    """Causal attention over the sequence spread on ``comm`` (the cp group) by ``layout``."""

    comm: Communicator
    """The cp group: rank i holds the tokens ``layout`` gives rank i."""
    layout: SequenceLayout
    exchange: Exchange = "ring"
    """How K/V reach every rank: ``ring`` or ``allgather``."""

    def __post_init__(self) -> None:
        if self.exchange not in EXCHANGES:
            raise ContextParallelError(
                "unknown context-parallel exchange", repr(self.exchange),
                f"the exchanges are {', '.join(EXCHANGES)}", "Use one of them")
        if self.comm.size != self.layout.cp:
            raise ContextParallelError(
                "context-parallel group does not match the layout",
                f"group {self.comm.name!r} of {self.comm.size} ranks",
                f"the layout splits the sequence over cp = {self.layout.cp} ranks",
                "Build the layout with cp equal to the size of the cp group")

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 docs: torch.Tensor | None = None, *, dropout_p: float = 0.0,
                 scale: float | None = None) -> torch.Tensor:
        """This rank's attention output (B, H, T_local, K); ``scale`` defaults to 1/√K.
        ``docs``: the whole window's document ids (B, seq_len) under document masking
        (`trainer.parallel.context.documents`), None for causal attention over the window."""
        check_dropout(dropout_p)
        self._check_shapes(q, k, v)
        if docs is not None:
            check_documents(docs, self.layout, q.shape[0], f"cp rank {self.comm.rank}")
        function = RingAttention if self.exchange == "ring" else AllGatherAttention
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        out: torch.Tensor = function.apply(q, k, v, self.comm, self.layout, scale, docs)  # type: ignore[no-untyped-call]  # torch's Function.apply
        return out

    def _check_shapes(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        where = (f"cp rank {self.comm.rank}: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                 f"v {tuple(v.shape)}")
        problem = ""
        if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
            problem = "q, k and v must be (batch, heads, tokens, head_dim), k and v alike"
        elif q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
            problem = "q and k/v differ in batch or head_dim"
        elif q.shape[1] % k.shape[1]:
            problem = f"{q.shape[1]} query heads do not group over {k.shape[1]} key/value heads"
        elif q.shape[2] != self.layout.local_len or k.shape[2] != self.layout.local_len:
            problem = (f"each rank holds {self.layout.local_len} tokens of the "
                       f"{self.layout.seq_len}-token sequence")
        if problem:
            raise ContextParallelError("cannot run context-parallel attention", where, problem,
                                       "Pass this rank's split of q, k and v (SequenceLayout)")
