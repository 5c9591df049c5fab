"""Turn the plain GPT into its tensor-parallel version, in one place (torchtitan's pattern).

``parallelize(model, tp, tracker=...)`` replaces, in every block, the four linear layers by
their Megatron counterparts and the embedding and head by vocabulary-parallel ones (a Llama's
blocks: `trainer.parallel.tensor.gqa`):

    attn.qkv   ColumnParallelLinear, stride 3: each rank gets q, k and v of its own heads
    attn.proj  RowParallelLinear (sums the heads' contributions: 1 all-reduce forward)
    mlp.fc     ColumnParallelLinear
    mlp.proj   RowParallelLinear (1 all-reduce forward)
    tok_emb    VocabParallelEmbedding (1 all-reduce forward)
    head       ColumnParallelLinear over the vocabulary, the logits stay sharded; tied heads
               share the embedding's shard (both are split along the vocabulary the same way)
    criterion  vocab-parallel cross entropy (3 small all-reduces, no gathered logits)

Attention itself runs unchanged on the rank's heads (it reads the head count from the qkv
weight); its probability dropout is pointed at the tracker's TP stream. Norms stay replicated.
Every shard is a *slice of the serial model's initialised weight*, so a TP model built from
``GPT(cfg, seed=s)`` computes what the serial model computes. Backward costs one all-reduce per
column layer (the input gradient) and none per row layer, so a block costs 2 all-reduces of
``B*T*D`` elements forward and 2 backward (Megatron's count without sequence parallelism).

The model is changed in place and returned; build the optimizer and `DataParallel` (on the DP
group) after this call, since they capture the parameters.
"""

from __future__ import annotations

from functools import partial
from typing import cast

from torch import nn

from trainer.comm.protocol import Communicator
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.model.layers import MLP, Attention, Block
from trainer.model.llama import GQAttention
from trainer.parallel.tensor.cross_entropy import mean_vocab_parallel_cross_entropy
from trainer.parallel.tensor.gqa import check_heads, shard_llama_block
from trainer.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from trainer.parallel.tensor.random import TP_RNG, RNGStatesTracker
from trainer.parallel.tensor.sharding import TensorParallelError


def check_divisible(cfg: GPTConfig, tp: int) -> None:
    """Refuse a model whose heads, widths or vocabulary do not split over ``tp`` ranks,
    naming every offending field at once."""
    sizes = {"n_head": cfg.n_head, "d_model": cfg.d_model, "mlp hidden": cfg.hidden,
             "vocab_size": cfg.vocab_rows}
    bad = [f"{name} = {value}" for name, value in sizes.items() if value % tp]
    if bad:
        raise TensorParallelError(
            "model does not split over the tensor-parallel group", f"--tp {tp}",
            f"{', '.join(bad)} not divisible by tp = {tp}",
            "Choose a tp that divides n_head and vocab_size (or change the model, e.g. "
            "--vocab-multiple 128 to pad the vocabulary)")
    if cfg.arch == "llama":
        check_heads(cfg, tp)


def shard_gpt_block(block: Block, cfg: GPTConfig, tp: Communicator, where: str) -> None:
    """Split one GPT block's attention and (dense) MLP over ``tp``, in place."""
    # The model declares nn.Linear (nn.Embedding) for what TP swaps for a sharded layer of the
    # same call signature: each swap is an ignore[assignment], here and in `parallelize`.
    attn, mlp = cast(Attention, block.attn), block.mlp
    attn.qkv = ColumnParallelLinear.from_linear(attn.qkv, tp, stride=3, name=f"{where}.attn.qkv")  # type: ignore[assignment]  # sharded swap
    attn.proj = RowParallelLinear.from_linear(attn.proj, tp, name=f"{where}.attn.proj")  # type: ignore[assignment]  # sharded swap
    attn.n_head //= tp.size
    if isinstance(mlp, MLP):  # MoE layers split their experts themselves (trainer.parallel.expert)
        mlp.fc = ColumnParallelLinear.from_linear(mlp.fc, tp, name=f"{where}.mlp.fc")  # type: ignore[assignment]  # sharded swap
        mlp.proj = RowParallelLinear.from_linear(mlp.proj, tp, name=f"{where}.mlp.proj")  # type: ignore[assignment]  # sharded swap


def parallelize(model: GPT, tp: Communicator, *,
                tracker: RNGStatesTracker | None = None) -> GPT:
    """Shard ``model`` over the TP group ``tp`` (a no-op at tp = 1). ``tracker`` supplies the
    TP random stream for attention dropout; it is required when the model has dropout."""
    if tp.size == 1:
        return model
    check_divisible(model.cfg, tp.size)
    if model.cfg.dropout > 0 and tracker is None:
        raise TensorParallelError(
            "tensor-parallel dropout needs its own random stream", f"tp rank {tp.rank}",
            "attention probabilities are split by head, and masks drawn from the shared "
            "stream would repeat across ranks", "Pass tracker=RNGStatesTracker(device)")
    shard_block = shard_llama_block if model.cfg.arch == "llama" else shard_gpt_block
    for index, block in model.layers():
        shard_block(block, model.cfg, tp, f"blocks.{index}")
        if tracker is not None:
            cast("Attention | GQAttention", block.attn).probs_rng = partial(tracker.fork, TP_RNG)
    if model.tok_emb is not None:
        model.tok_emb = VocabParallelEmbedding.from_embedding(model.tok_emb, tp, name="tok_emb")  # type: ignore[assignment]  # sharded swap
    if model.head is not None:
        head = ColumnParallelLinear.from_linear(model.head, tp, name="head")
        if model.cfg.tied and model.tok_emb is not None:  # the same vocabulary slice: share it
            head.weight = cast(nn.Parameter, model.tok_emb.weight)  # torch's stub: a Tensor
        model.head = head  # type: ignore[assignment]  # sharded swap
        model.vocab_start = tp.rank * (model.cfg.vocab_rows // tp.size)  # masks padded rows
    model.criterion = partial(mean_vocab_parallel_cross_entropy, comm=tp)
    return model
