"""Put a rank's model on its share of every sequence: the one place a run turns context
parallelism on (`trainer.training.run.build_run`, when ``--cp`` is above 1).

The model's code does not change. Two things that depend on where a token sits are replaced:

* the rotary tables (``rope_cos``/``rope_sin``, one row per position): the rank's rows of the
  whole sequence's tables, in its local order (`SequenceLayout.positions`), so that local token
  i is rotated at its global position, exactly as the serial model rotates it. The blocks take
  ``cos[:T]`` of what they are given, and T is now the rank's token count.
* each block's attention core (``attn.core``): `ContextParallelAttention`, whose causal mask is
  decided by global positions (`trainer.parallel.context.plan`). The hooks around it stay:
  selective recomputation (``attn.core_runner``) re-runs the core in backward, exchange
  included, and full recomputation re-runs the block the same way (see
  `trainer.parallel.context`).

Everything else is per token (embedding, norms, MLP, head, the loss) and needs nothing: the
data loader gives the rank its tokens and their own targets (`trainer.data.batches.Keep`).
"""

from __future__ import annotations

from functools import partial

from trainer.comm.protocol import Communicator
from trainer.data.batches import Keep
from trainer.model.gpt import GPT
from trainer.parallel.context.attention import ContextParallelAttention, Exchange
from trainer.parallel.context.layout import SequenceLayout


def context_parallel(model: GPT, comm: Communicator, exchange: Exchange = "ring") -> GPT:
    """``model`` (a whole model, a pipeline stage or a TP shard) attending over the sequence
    spread on ``comm``, the cp group; returns it, changed in place."""
    layout = SequenceLayout(model.cfg.seq_len, comm.size)
    attention = ContextParallelAttention(comm, layout, exchange)
    positions = layout.positions(comm.rank, model.rope_cos.device)
    model.rope_cos = model.rope_cos.index_select(0, positions)
    model.rope_sin = model.rope_sin.index_select(0, positions)
    for _, block in model.layers():
        block.attn.core = attention  # type: ignore[assignment]  # torch's __setattr__ stub: modules only
    return model


def keep_chunks(seq_len: int, comm: Communicator) -> Keep:
    """What the data loader keeps of each window for this cp rank: its two chunks."""
    layout = SequenceLayout(seq_len, comm.size)
    return partial(layout.split_tensor, rank=comm.rank, dim=1)
