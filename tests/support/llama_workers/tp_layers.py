"""One rank of the Llama tensor-parallel layer test (`tests.trainer.test_llama_tp`).

    mpiexec -n N python -m tests.support.mpi_worker tests.support.llama_workers.tp_layers:run OUT

Every rank builds the serial fp64 Llama of each case, runs one forward and backward of a fixed
batch on it, then splits its blocks over the whole world (`trainer.parallel.tensor.gqa`) and
runs the same batch again. It returns both losses and both sets of gradients, the sharded
ones re-assembled to their serial shape (`gather_full`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tests.support.numerics import float64
from trainer.comm.bootstrap import init
from trainer.model.config import PRESETS
from trainer.model.llama import Llama
from trainer.model.llama_config import LlamaShape
from trainer.parallel.tensor.gqa import shard_llama_block
from trainer.parallel.tensor.sharding import gather_full, shard_spec

TINY = PRESETS["llama-tiny"]
CASES = {"gqa": replace(TINY, vocab_size=96),   # 8 heads, 2 kv heads
         "mha": replace(TINY, vocab_size=96, llama=LlamaShape(n_kv_head=8, multiple_of=16))}


def grads(model: torch.nn.Module, comm: Any) -> dict[str, torch.Tensor]:
    return {name: gather_full(p.grad, shard_spec(p), comm) for name, p in
            model.named_parameters()}


def run(out: Path) -> dict[str, Any]:
    world = init()
    result: dict[str, Any] = {}
    with float64():
        for name, cfg in CASES.items():
            idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1),
                                generator=torch.Generator().manual_seed(1))
            serial = Llama(cfg, seed=4)
            loss = serial.loss(idx[:, :-1], idx[:, 1:])
            loss.backward()
            split = Llama(cfg, seed=4)
            for index, block in split.layers():
                shard_llama_block(block, cfg, world.comm, f"blocks.{index}")
            tp_loss = split.loss(idx[:, :-1], idx[:, 1:])
            tp_loss.backward()
            result[name] = {"loss": loss.item(), "tp_loss": tp_loss.item(),
                            "grads": grads(serial, world.comm),
                            "tp_grads": grads(split, world.comm),
                            "kv": type(split.blocks["0"].attn.kv).__name__}
    return result
