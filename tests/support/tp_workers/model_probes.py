"""Model-level probes of the TP workers: dropout streams, recompute, training (see `worker`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from tests.support.numerics import float64
from tests.support.tp_workers.cases import CASES, STEPS, case_config
from tests.support.tp_workers.layer_probes import grads_of
from trainer.comm.bootstrap import World
from trainer.comm.mesh import Mesh
from trainer.comm.protocol import Communicator
from trainer.config.options import resolve_dp
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.parallel.tensor import (
    TP_RNG,
    RNGStatesTracker,
    ShardSpec,
    checkpoint,
    full_state,
    shard_tensor,
)
from trainer.parallel.tensor.parallelize import parallelize
from trainer.training.run import build_run
from trainer.training.step import train_step

DROP_CFG = GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=16, dropout=0.2)


def _dropout_model(tp: Communicator, *, same_heads: bool) -> tuple[GPT, RNGStatesTracker]:
    tracker = RNGStatesTracker()
    model = parallelize(GPT(DROP_CFG, seed=4), tp, tracker=tracker)
    if same_heads:
        # Give every rank rank 0's heads, so their attention outputs can only differ through
        # the attention-probability dropout masks.
        serial = GPT(DROP_CFG, seed=4)
        for key, block in model.blocks.items():
            full = serial.blocks[key].attn.qkv.weight
            with torch.no_grad():
                block.attn.qkv.weight.copy_(shard_tensor(full, 0, tp.size,
                                                         ShardSpec(0, 3)))
    return model, tracker


def _record_forward(model: GPT, tracker: RNGStatesTracker, tp_seed: int,
                    train: bool) -> dict[str, torch.Tensor]:
    """Embedding-dropout output, every block's output and every attention's per-rank output
    (the row-parallel proj's input) of one forward pass."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [model.emb_drop.register_forward_hook(
        lambda _m, _i, out: seen.__setitem__("emb", out.detach().clone()))]
    for key, block in model.blocks.items():
        hooks.append(block.register_forward_hook(
            lambda _m, _i, out, k=key: seen.__setitem__(f"block{k}", out.detach().clone())))
        hooks.append(block.attn.proj.register_forward_pre_hook(
            lambda _m, args, k=key: seen.__setitem__(f"heads{k}", args[0].detach().clone())))
    model.train(train)
    torch.manual_seed(1000)               # the default stream: same on every TP rank
    tracker.seed(TP_RNG, tp_seed)
    idx = torch.randint(0, 256, (2, DROP_CFG.seq_len), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(idx)
    for hook in hooks:
        hook.remove()
    return seen


def dropout_probe(tp: Communicator) -> dict[str, Any]:
    rank = tp.rank
    model, tracker = _dropout_model(tp, same_heads=False)
    same, same_tracker = _dropout_model(tp, same_heads=True)
    return {
        "model": _record_forward(model, tracker, 2000 + rank, train=True),
        "same_heads": _record_forward(same, same_tracker, 2000 + rank, train=True),
        "same_heads_eval": _record_forward(same, same_tracker, 2000 + rank, train=False),
        "same_heads_one_seed": _record_forward(same, same_tracker, 2000, train=True),
    }


def recompute_probe(tp: Communicator) -> dict[str, Any]:
    """One TP block with dropout: plain, under our `checkpoint`, and under torch's checkpoint
    (which restores the default generator but not the tracker's TP stream)."""
    model, tracker = _dropout_model(tp, same_heads=False)
    model.train()
    block = model.blocks["0"]
    h0 = torch.randn(2, DROP_CFG.seq_len, DROP_CFG.d_model,
                     generator=torch.Generator().manual_seed(9))
    g = torch.randn(h0.shape, generator=torch.Generator().manual_seed(10))

    def fn(h: torch.Tensor) -> torch.Tensor:
        return block(h, model.rope_cos, model.rope_sin)

    results = {}
    for mode in ("plain", "ours", "torch"):
        block.zero_grad(set_to_none=True)
        torch.manual_seed(77)
        tracker.seed(TP_RNG, 88 + tp.rank)
        h = h0.clone().requires_grad_(True)
        if mode == "plain":
            out = fn(h)
        elif mode == "ours":
            out = checkpoint(fn, tracker, h)
        else:
            out = torch_checkpoint(fn, h, use_reentrant=False, preserve_rng_state=True)
        torch.rand(5)  # the streams move on before backward, as they would in training
        with tracker.fork():
            torch.rand(5)
        (out * g).sum().backward()
        results[mode] = {"out": out.detach(), "dh": h.grad, "grads": grads_of(block)}
    return results


def train_case(name: str, world: World, mesh: Mesh, out: Path) -> dict[str, Any]:
    """Train one case with the trainer's own build_run/train_step at this layout."""
    dims = mesh.shape
    cfg = resolve_dp(case_config(name, tp=dims.tp, dp=dims.dp,
                                 run_dir=str(out / f"{name}-tp{dims.tp}")), world.size)
    run = build_run(cfg, mesh)
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        rec = train_step(run, step)
        losses.append(rec.loss)
        norms.append(rec.grad_norm)
    return {"losses": losses, "norms": norms, "params": full_state(run.model, mesh.group("tp")),
            "local_shapes": {n: tuple(p.shape) for n, p in run.model.named_parameters()}}


def train_all(world: World, mesh: Mesh, out: Path) -> dict[str, Any]:
    """Every training case in fp64, as the single-process reference (tests/support/numerics.py)."""
    with float64():
        return {name: train_case(name, world, mesh, out) for name in CASES}

