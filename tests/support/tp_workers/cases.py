"""What the TP workers compute and what the single-process references compare it with.

Shared by the MPI worker and the pytest process, so both build bit-identical inputs: the layer
tensors come from a seeded generator, the training cases from one config recipe.
"""

from __future__ import annotations

import functools

import torch

from tests.support.serial_reference import train_serially
from trainer.config.options import TrainConfig, make_config

# -- layers ----------------------------------------------------------------------------------

#: The rank function every TP test reads (one run per world size: `tests.support.mpi_runs`).
WORKER = "tests.support.tp_workers.worker:run"

B, T, D_IN, D_OUT, VOCAB = 2, 8, 16, 24, 32
"""Divisible by 4 (and D_OUT by 3 * 4, for the stride-3 QKV split)."""

LINEAR_VARIANTS = ("column", "column_stride3", "column_gather", "row", "row_scatter",
                   "column_sp", "row_sp")


@functools.cache
def layer_tensors() -> dict[str, torch.Tensor]:
    """fp64, so the layers and their serial counterparts agree far inside torch.testing's
    fp64 tolerance whatever the summation order (tests/support/numerics.py)."""
    g = torch.Generator().manual_seed(5)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "x": randn(B, T, D_IN), "w": randn(D_OUT, D_IN), "b": randn(D_OUT),
        "gy": randn(B, T, D_OUT),
        "emb": randn(VOCAB, D_IN), "idx": torch.randint(0, VOCAB, (B, T), generator=g),
        "gemb": randn(B, T, D_IN),
        "logits": 3 * randn(B * T, VOCAB), "target": torch.randint(0, VOCAB, (B * T,),
                                                                   generator=g),
        "gloss": randn(B * T),
    }


# -- training --------------------------------------------------------------------------------

STEPS = 3
_TINY = {"n_layer": 2, "n_head": 4, "d_model": 32, "seq_len": 16}
_COMMON = {"model": "tiny", "steps": STEPS, "global_batch": 8, "lr": 3e-3, "warmup_steps": 1,
           "seed": 11, "data_cap_mb": 0.25, "grad_clip": 0.5}

CASES: dict[str, tuple[dict, dict]] = {
    # tied embedding/head (one vocab-sharded parameter used twice), LayerNorm, no biases
    "tied": ({}, {}),
    # untied head, RMSNorm, biases (replicated row-parallel biases), 2 microbatches
    "untied": ({"microbatches": 2, "bucket_size": 3000},
               {"tied": False, "norm": "rmsnorm", "bias": True}),
}
#: The case trained through `python -m trainer.train` (fp32) with a checkpoint and a resume.
CKPT_CASE = "tied"
#: Both cases clip (grad_clip 0.5 is below the tiny model's gradient norm), so the
#: TP-summed global norm decides every update.


def layouts(world: int) -> list[tuple[int, int]]:
    """(tp, dp) pairs with tp in {1, 2, 4}, dp in {1, 2} that use exactly ``world`` ranks."""
    return [(tp, world // tp) for tp in (1, 2, 4) if world % tp == 0 and world // tp in (1, 2)]


def case_config(name: str, *, tp: int = 1, dp: int = 0, **train: object) -> TrainConfig:
    over, gpt = CASES[name]
    return make_config({**_COMMON, **over, "tp": tp, "dp": dp, **train}, {**_TINY, **gpt})


def cli_flags(name: str) -> list[str]:
    """``python -m trainer.train`` flags that give `case_config(name)`."""
    over, gpt = CASES[name]
    flags = []
    for key, value in {**_COMMON, **over, **_TINY, **gpt}.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


@functools.cache
def serial_reference(name: str) -> dict:
    """One process, plain model, the whole global batch (in the case's microbatches, as a
    single-device run with gradient accumulation does), torch's own clipping: the losses,
    the gradient norms (before clipping) and the final parameters."""
    cfg = case_config(name)
    return train_serially(cfg, STEPS)
