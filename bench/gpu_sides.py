"""The two sides `bench.gpu` times, on one process: dtrain's full training path and a plain
PyTorch loop of the same model.

* ``dtrain``: `trainer.training.run.build_run` on a world of one rank with its mesh (every
  group of one rank), as ``python -m trainer.train`` builds it: the DP gradient buffer (fp32
  main gradients), `trainer.parallel.tensor.parallelize` at TP = 1, PP = 1, bf16 parameters
  with fp32 main weights (`trainer.optim.mixed_precision`), fused AdamW on CUDA, the guard and
  gradient clipping,
  ``--compile`` when asked; batches from the corpus.
* ``plain``: `trainer.model.gpt.GPT` (the plain model; no parallel code lives in it) in fp32 under
  ``torch.autocast(bf16)``, fused AdamW on CUDA (the per-tensor loop elsewhere:
  `trainer.gpu.settings`), ``clip_grad_norm_``; blocks compiled with ``torch.compile`` when
  asked; one fixed batch on the device, so the reference pays no data loading at all.

Both report the median step time over the timed steps, the device synchronised around each.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch

from trainer.comm.bootstrap import World
from trainer.comm.mesh import Mesh
from trainer.comm.topology import MeshShape
from trainer.config.options import TrainConfig
from trainer.gpu.settings import adamw_kernel
from trainer.model.gpt import GPT
from trainer.training.run import build_run
from trainer.training.step import run_step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[int], None], device: torch.device, *, warmup: int,
               steps: int) -> float:
    """Median seconds per call of ``step(i)`` after ``warmup`` untimed calls."""
    for i in range(1, warmup + 1):
        step(i)
    times = []
    for i in range(warmup + 1, warmup + steps + 1):
        _sync(device)
        start = time.perf_counter()
        step(i)
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) if times else 0.0


def mesh_of_one(world: World) -> Mesh:
    """The mesh of a world of one rank (built once: on CUDA each group is an NCCL
    communicator)."""
    return Mesh.build(world.comm, MeshShape(), world.device)


def dtrain_side(cfg: TrainConfig, world: World, mesh: Mesh, *, warmup: int,
                steps: int) -> float:
    """Median step seconds of the trainer's own step on ``cfg`` (dp = tp = pp = 1)."""
    try:
        run = build_run(cfg.with_options(dp=1), mesh)
        return time_steps(lambda i: run_step(run, i), world.device, warmup=warmup, steps=steps)
    finally:
        release(world.device)


def plain_side(cfg: TrainConfig, device: torch.device, *, warmup: int, steps: int) -> float:
    """Median step seconds of a plain autocast-bf16 loop of the same model and batch size."""
    try:
        return time_steps(_plain_step(cfg, device), device, warmup=warmup, steps=steps)
    finally:
        release(device)


def _plain_step(cfg: TrainConfig, device: torch.device) -> Callable[[int], None]:
    model = GPT(cfg.gpt, seed=cfg.seed).to(device)
    if cfg.compile:
        for block in model.blocks.values():
            block.forward = torch.compile(block.forward)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.optimizer.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.optimizer.weight_decay, **adamw_kernel(params))
    gen = torch.Generator().manual_seed(cfg.seed)
    shape = (cfg.data.global_batch, cfg.gpt.seq_len)
    x = torch.randint(0, 256, shape, generator=gen).to(device)
    y = torch.randint(0, 256, shape, generator=gen).to(device)

    def step(_: int) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model.loss(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.optimizer.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def release(device: torch.device) -> None:
    """Give the memory of a finished side back before the next one is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fits(cfg: TrainConfig, world: World, mesh: Mesh) -> bool:
    """Whether one dtrain step of ``cfg`` fits in the device's memory."""
    try:
        dtrain_side(cfg, world, mesh, warmup=1, steps=0)
    except torch.OutOfMemoryError:
        release(world.device)
        return False
    return True


def largest_batch(cfg: TrainConfig, world: World, mesh: Mesh, cap: int) -> int:
    """The largest power-of-two micro-batch up to ``cap`` whose dtrain step fits (at least 1)."""
    batch = 1
    while batch * 2 <= cap and fits(cfg.with_options(global_batch=batch * 2), world, mesh):
        batch *= 2
    return batch
