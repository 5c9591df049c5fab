"""One rank of the ZeRO-2 tests; returns what it saw (`tests.support.mpi_runs`).

    mpiexec -n 4 python -m tests.support.mpi_worker tests.support.zero_workers.stage2:run OUT

On 4 ranks every case of `STAGE2_CASES` is trained in fp64 with ``--zero 1`` and ``--zero 2``
(5 steps, 2 microbatches, clipping on), with the trainer's own ``build_run``/``train_step``;
after each step the ZeRO-2 run records its gradient memory (`held`, and the staged bytes: the
whole-bucket tensors alive between steps and at most during the step). On 2 ranks, fp32 with
one microbatch (where zero 1 and zero 2 run the same operations on the same numbers): zero 1
and zero 2 side by side, in fp32, bf16 and bf16-on-the-wire, and a zero 2 run stopped at step
2 and resumed at zero 1 and zero 0, and a zero 0 run resumed at zero 2, each against the
uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.numerics import float64
from tests.support.zero_workers.cases import config
from trainer.comm.bootstrap import World, init
from trainer.parallel.zero import ShardedGradients
from trainer.parallel.zero.memory import held_bytes
from trainer.train import train
from trainer.training.run import build_run, mesh_for
from trainer.training.step import train_step

STEPS = 5
RESUME_STEPS = 4
#: (name, dp, tp, pp, overrides): trained at zero 1 and zero 2 on 4 ranks, in fp64.
STAGE2_CASES = [("dp4", 4, 1, 1, {}),
                ("dp4-no-overlap", 4, 1, 1, {"overlap": False}),
                ("dp2-tp2", 2, 2, 1, {}),
                ("dp2-tp2-sp-recompute", 2, 2, 1, {"sequence_parallel": True,
                                                   "recompute": "full"}),
                ("dp2-pp2", 2, 1, 2, {"schedule": "1f1b"}),
                ("dp2-pp2-gpipe", 2, 1, 2, {"schedule": "gpipe", "tied": False}),
                ("dp4-shard-2", 4, 1, 1, {"zero_shard_size": 2})]
#: The 2-rank comparisons: one microbatch, so zero 1 and zero 2 reduce the same sums.
PAIRS = {"fp32": {}, "bf16": {"precision": "bf16"}, "bf16-wire": {"grad_reduce_dtype": "bf16"}}


def stage2_config(name: str, **train: object) -> Any:
    _, dp, tp, pp, over = next(c for c in STAGE2_CASES if c[0] == name)
    return config(dp, tp, pp, over, steps=STEPS, **train)


def train_case(world: World, cfg: Any, steps: int) -> dict[str, Any]:
    run = build_run(cfg, mesh_for(cfg, world))
    losses, staged = [], []
    for step in range(1, steps + 1):
        losses.append(train_step(run, step).loss)
        if isinstance(run.dp, ShardedGradients):
            staged.append((run.dp.staged_bytes, run.dp.peak_staged_bytes))
    held = held_bytes(run.model.parameters(), run.dp.buffer, run.weights.optimizer)
    size = run.dp.buffer.element_size()  # what a whole gradient buffer, and each bucket, take
    whole = sum(p.numel() for p in run.dp.params) * size
    buckets = [(b.end - b.start) * size for b in run.weights.layout.buckets]
    return {"losses": losses, "held": held, "staged": staged, "whole_grad_bytes": whole,
            "bucket_bytes": buckets, "n_params": sum(p.numel() for p in run.dp.params),
            "local": {n: t.detach().clone() for n, t in run.model.state_dict().items()}}


def resumes(world: World, out: Path) -> dict[str, Any]:
    """fp32, dp 2, one microbatch, no clipping: zero 2 uninterrupted to RESUME_STEPS; stopped
    at 2 and resumed at zero 1 and at zero 0; a zero 0 run stopped at 2 resumed at zero 2."""
    base = config(2, 1, 1, {}, steps=RESUME_STEPS, microbatches=1, grad_clip=0.0)
    got: dict[str, Any] = {"whole": train(base.with_options(zero=2,
                                                            run_dir=str(out / "whole")),
                                          world).losses}
    for first, then in ((2, 1), (2, 0), (0, 2)):
        cfg = base.with_options(run_dir=str(out / f"{first}to{then}"))
        before = train(cfg.with_options(zero=first, stop_at=2), world).losses
        after = train(cfg.with_options(zero=then, resume=True), world)
        got[f"{first}to{then}"] = {"losses": before + after.losses, "start": after.start_step}
    return got


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    result: dict[str, Any] = {"rank": world.rank}
    if world.size == 4:
        with float64():
            for name, *_ in STAGE2_CASES:
                result[name] = {z: train_case(world, stage2_config(
                    name, zero=z, run_dir=str(out / f"{name}-{z}")), STEPS) for z in (1, 2)}
        return result
    for name, over in PAIRS.items():
        result[name] = {z: train_case(world, config(
            2, 1, 1, over, zero=z, steps=3, microbatches=1,
            run_dir=str(out / f"{name}-{z}")), 3) for z in (1, 2)}
    result["resume"] = resumes(world, out)
    return result
