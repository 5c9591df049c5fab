"""ZeRO-1 checkpoints: the sharded state gathered into the layout every run reads.

A checkpoint of a ``--zero 1`` run holds exactly what a ``--zero 0`` run's holds: the model
state with the full fp32 (main) weights and torch AdamW's state dict over the whole model (one
``exp_avg`` and ``exp_avg_sq`` per parameter, indexed as `trainer.optim.optimizer.param_groups`
orders them). Saving all-gathers each bucket's shards over DP (collective; DP rank 0 keeps and
writes them, so it briefly holds the whole state, as a zero 0 rank always does); loading
is `ZeroOptimizer` slicing its pieces out of the restored full state (every rank reads the
whole optimizer file, keeps its pieces and drops the rest). So the shard layout is
re-derived on every start: a run resumes at any dp, with or without ZeRO, and at the same dp
the pieces get back exactly the values they had (bit-exact resume).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from trainer.comm.protocol import ReduceOp
from trainer.zero.optimizer import ZeroOptimizer

_MOMENTS = ("exp_avg", "exp_avg_sq")


@torch.no_grad()
def full_state(zero: ZeroOptimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """(model state, optimizer state) of the whole model on DP rank 0, the writer; None on
    the others, which take part in the gathers but keep nothing (collective over DP)."""
    step = _steps_taken(zero)
    kinds = ([] if zero.dtype is None else ["main"]) + (list(_MOMENTS) if step else [])
    full = {kind: _gather(zero, kind) for kind in kinds}
    if zero.sync.comm.rank != 0:
        return None
    model = zero.model.state_dict()
    if "main" in full:  # the fp32 main weights in place of the bf16 parameters
        main_of = {p.data_ptr(): full["main"][i] for i, p in enumerate(zero.params)}
        model = {name: main_of.get(t.data_ptr(), t) for name, t in model.items()}
    index = {id(p): i for i, p in enumerate(itertools.chain(*zero.full_groups))}
    position = {id(p): i for i, p in enumerate(zero.params)}
    # torch keeps ``step`` as an fp32 tensor, fp64 when that is the default dtype
    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    state = {index[id(p)]: {"step": torch.tensor(float(step), dtype=step_dtype),
                            **{m: full[m][position[id(p)]] for m in _MOMENTS}}
             for p in zero.params} if step else {}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [index[id(p)] for p in params]}
              for g, params in zip(zero.optimizer.param_groups, zero.full_groups, strict=True)]
    return model, {"state": state, "param_groups": groups}


def _steps_taken(zero: ZeroOptimizer) -> int:
    """AdamW's step count (a rank whose shards hold only padding has no state of its own)."""
    mine = max((int(s["step"]) for s in zero.optimizer.state.values() if "step" in s),
               default=0)
    device = zero.sync.buffer.device
    count = torch.tensor([mine], dtype=torch.int64, device=device)
    if zero.sync.comm.size > 1:
        zero.sync.comm.all_reduce(count, ReduceOp.MAX)
    return int(count)


def _gather(zero: ZeroOptimizer, kind: str) -> list[torch.Tensor]:
    """``kind`` (main weights or a moment) of every parameter, whole, in buffer order."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(zero.params)
    dtype = torch.float32 if zero.dtype is not None else zero.params[0].dtype  # the pieces'
    for k, bucket in enumerate(zero.layout.buckets):
        values = [(piece.at, _of(zero, m, kind).view(-1))
                  for m, piece in zip(zero.main, zero.pieces, strict=True) if piece.bucket == k]
        flat, handle = zero.post_gather(k, values, dtype=dtype)
        if handle is not None:
            handle.wait()
        if zero.sync.comm.rank != 0:
            continue  # only the writer keeps the whole state, one bucket at a time elsewhere
        for i in bucket.params:
            offset = zero.layout.offsets[i] - bucket.start
            p = zero.params[i]
            out[i] = flat[offset:offset + p.numel()].view(p.shape).clone()
    return out


def _of(zero: ZeroOptimizer, main: torch.nn.Parameter, kind: str) -> torch.Tensor:
    return main.detach() if kind == "main" else zero.optimizer.state[main][kind]
