"""Layer-level probes run by every rank of the TP group (see `worker`).

Each probe returns ``{name: (tensor, spec)}``: ``spec`` is ``None`` when every rank must hold
the full serial tensor, else the `ShardSpec` that re-assembles the ranks' pieces into it. The
test builds the same serial computation from `cases.layer_tensors` and compares.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.support.tp_workers.cases import LINEAR_VARIANTS, layer_tensors
from trainer import checkpoint
from trainer.comm.protocol import Communicator
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    shard_tensor,
    vocab_parallel_cross_entropy,
)
from trainer.parallel.tensor.counting import CountingCommunicator
from trainer.parallel.tensor.parallelize import parallelize

Piece = tuple[torch.Tensor, ShardSpec | None]
SEQ = ShardSpec(1)     # sequence dim of (B, T, D)
LAST = ShardSpec(2)    # feature dim of (B, T, D)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def linear_probe(variant: str, tp: Communicator) -> dict[str, Piece]:
    """One of `LINEAR_VARIANTS`: output, input grad, weight grad, bias grad."""
    t = layer_tensors()
    r, n = tp.rank, tp.size
    sp = variant.endswith("_sp")
    if variant.startswith("column"):
        stride = 3 if variant == "column_stride3" else 1
        gather = variant == "column_gather"
        layer = ColumnParallelLinear(t["w"], t["b"], tp, stride=stride, gather_output=gather,
                                     sequence_parallel=sp)
        x = _leaf(t["x"].chunk(n, dim=1)[r] if sp else t["x"])
        y_spec = None if gather else ShardSpec(2, stride)
        w_spec = ShardSpec(0, stride)
        x_spec, b_spec = (SEQ if sp else None), w_spec
    else:
        layer = RowParallelLinear(t["w"], t["b"], tp, input_is_parallel=variant != "row_scatter",
                                  sequence_parallel=sp)
        x = _leaf(t["x"] if variant == "row_scatter" else shard_tensor(t["x"], r, n, LAST))
        y_spec, w_spec, b_spec = (SEQ if sp else None), ShardSpec(1), None
        x_spec = None if variant == "row_scatter" else LAST
    y = layer(x)
    gy = t["gy"] if y_spec is None else shard_tensor(t["gy"], r, n, y_spec)
    (y * gy).sum().backward()
    return {"y": (y.detach(), y_spec), "dx": (x.grad, x_spec),
            "dw": (layer.weight.grad, w_spec), "db": (layer.bias.grad, b_spec)}


def embedding_probe(tp: Communicator) -> dict[str, Piece]:
    t = layer_tensors()
    layer = VocabParallelEmbedding(t["emb"], tp)
    out = layer(t["idx"])
    (out * t["gemb"]).sum().backward()
    return {"y": (out.detach(), None), "dw": (layer.weight.grad, ShardSpec(0))}


def cross_entropy_probe(tp: Communicator) -> dict[str, Piece]:
    t = layer_tensors()
    logits = _leaf(shard_tensor(t["logits"], tp.rank, tp.size, ShardSpec(1)))
    loss = vocab_parallel_cross_entropy(logits, t["target"], tp)
    (loss * t["gloss"]).sum().backward()
    return {"loss": (loss.detach(), None), "dlogits": (logits.grad, ShardSpec(1))}


def all_layer_probes(tp: Communicator) -> dict[str, dict[str, Piece]]:
    out = {v: linear_probe(v, tp) for v in LINEAR_VARIANTS}
    out["embedding"] = embedding_probe(tp)
    out["cross_entropy"] = cross_entropy_probe(tp)
    return out


COUNT_CFG = GPTConfig(n_layer=3, n_head=4, d_model=32, seq_len=16)
COUNT_BATCH = 2


def count_probe(tp: Communicator) -> dict[str, Any]:
    """Collectives of one forward and one backward of the TP GPT, by phase and op."""
    counter = CountingCommunicator(tp)
    model = parallelize(GPT(COUNT_CFG, seed=0), counter)
    x = torch.randint(0, 256, (COUNT_BATCH, COUNT_CFG.seq_len),
                      generator=torch.Generator().manual_seed(0))
    counter.phase = "forward"
    loss = model.loss(x, x)
    counter.phase = "backward"
    loss.backward()
    return {"counts": {f"{ph}/{op}": (c.calls, c.bytes) for (ph, op), c in counter.counts.items()},
            "sizes": list(counter.sizes)}


def refusal_probe(tp: Communicator) -> str:
    """A model whose heads and vocabulary do not split over this TP size (raises before any
    collective, so every rank can try it)."""
    size = tp.size
    cfg = GPTConfig(n_layer=1, n_head=size + 1, d_model=4 * (size + 1), vocab_size=255,
                    seq_len=8)
    try:
        parallelize(GPT(cfg, seed=0), tp)
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def grads_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def checkpoint_failure_probe(tp: Communicator, out: Path) -> dict[str, Any]:
    """The TP writers save together and rank 1's tensor file cannot be written (a dtype no
    checkpoint holds): every writer must fail with the cause, none may hang, nothing may be
    committed."""
    state = {"w": torch.zeros(2)}
    if tp.rank == 1:
        state["bad"] = torch.zeros(4, 4, dtype=torch.complex64)
    root = out / "ckpt-failure"
    try:
        checkpoint.save(root, 1, tensors=state, contents=[], meta={}, world=tp)
        message = "no error"
    except checkpoint.CheckpointError as exc:
        message = str(exc)
    tp.barrier()
    return {"message": message, "latest": checkpoint.latest(root)}
