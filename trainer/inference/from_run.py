"""``python -m trainer.generate --from-run --run-dir DIR --tp N``: sample from a run's newest
checkpoint on the ranks of a job, each holding only its ZeRO-3 shards, switched to tensor
parallelism for the sampling (`trainer.inference.switch`).

    mpiexec -n 4 python -m trainer.generate --from-run --run-dir runs/z3 --tp 2 --prompt "def "

The run is rebuilt from the options its checkpoint recorded (meta.json) as a ZeRO-3 run over
this job's ranks (dp = the world size, whatever layout or stage it was trained at: a
checkpoint resumes at any layout), so no rank ever holds the whole model; the model is then
regathered into ``--tp``-way tensor-parallel groups of consecutive ranks, and every group
samples the same prompt with the same seed. Rank 0 prints the sample. For one process without
MPI, ``--run-dir`` alone merges the checkpoint instead (`trainer.inference.merge`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from trainer import checkpoint
from trainer.checkpoint.run_dir import folder
from trainer.comm.bootstrap import init
from trainer.config.options import OPTIONS, TrainConfig, make_config
from trainer.errors import ConfigError
from trainer.inference.switch import generate_tp
from trainer.parallel.zero import Zero3Optimizer
from trainer.training.run import build_run, mesh_for

#: What a ZeRO-3 run over plain data parallelism sets, whatever the run trained with.
_AS_ZERO3 = {"tp": 1, "pp": 1, "zero": 3, "precision": "fp32", "sequence_parallel": False,
             "recompute": "none", "compile": False, "microbatches": 1, "resume": True,
             "memory_budget": 0.0, "init_from_hf": None}


def run_config(run_dir: Path, world_size: int) -> TrainConfig:
    """The run's recorded options as a ZeRO-3 run over ``world_size`` data-parallel ranks."""
    path = checkpoint.latest(folder(run_dir))
    if path is None:
        raise checkpoint.CheckpointError(
            "no checkpoint to sample from", str(run_dir), "there is no committed step-<N> "
            "folder", "Train with --run-dir pointing here first (a checkpoint is saved at the "
            "end)")
    _, meta = checkpoint.read_meta(path)
    options = {k: v for k, v in meta["config"].items() if k in OPTIONS}
    if options.get("moe_experts", 0):
        raise ConfigError("unsupported combination", "--from-run with a mixture-of-experts "
                          "run", "the generation switch splits dense blocks only",
                          "Sample it on one process: drop --from-run")
    return make_config({**options, **_AS_ZERO3, "dp": world_size, "run_dir": str(run_dir)})


def sample_from_run(args: argparse.Namespace, prompt: list[int]) -> list[int] | None:
    """The ids continuing ``prompt`` on rank 0, None on the other ranks."""
    world = init()
    cfg = run_config(Path(args.run_dir), world.size)
    r = build_run(cfg, mesh_for(cfg, world))
    if not isinstance(r.weights, Zero3Optimizer):  # _AS_ZERO3 makes it one
        raise ConfigError("not a ZeRO-3 run", args.run_dir, "the switch regathers ZeRO-3 "
                          "units", "Drop --from-run")
    ids = generate_tp(r.model, r.weights.units, prompt, tp=args.tp, tokens=args.tokens,
                      temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    return ids if world.rank == 0 else None
