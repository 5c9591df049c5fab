"""One rank of the ZeRO-3 tests; returns what it saw (`tests.support.mpi_runs`).

    mpiexec -n 4 python -m tests.support.mpi_worker tests.support.zero_workers.stage3:run OUT

Every case of `STAGE3_CASES` is trained at dp 4 with ``--zero 3`` in fp64 for 5 steps (2
microbatches, clipping on) with the trainer's own ``build_run``/``train_step``; after each step
the rank records the bytes of gathered units it holds (none between steps) and the most it
held during the step, and at the end its whole parameters, gathered once. Then, through
``trainer.train.train`` (evaluation and checkpoints included), a zero 3 run stopped at step 2
is resumed at zero 1 and at zero 0, and a zero 1 run at zero 3, each against an uninterrupted
zero 3 run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.numerics import float64
from tests.support.zero_workers.cases import config
from trainer.comm.bootstrap import World, init
from trainer.parallel.zero import Zero3Optimizer
from trainer.placement import placement_of
from trainer.train import train
from trainer.training.run import build_run, mesh_for
from trainer.training.step import train_step

STEPS = 5
#: (name, dp, tp, overrides): each trained on 4 ranks at zero 3 in fp64 (2 microbatches and
#: clipping on unless overridden, `tests.support.zero_workers.cases`).
STAGE3_CASES = [
    ("dp4", 4, 1, {"n_layer": 6}),
    ("dp4-untied-no-prefetch", 4, 1, {"n_layer": 6, "tied": False, "zero_prefetch": 0}),
    ("dp4-prefetch-2-no-overlap", 4, 1, {"n_layer": 6, "zero_prefetch": 2, "overlap": False}),
    ("dp2-tp2", 2, 2, {"n_layer": 4}),
    ("dp2-tp2-sp-recompute-full", 2, 2, {"n_layer": 4, "sequence_parallel": True,
                                         "recompute": "full"}),
    ("dp4-recompute-selective", 4, 1, {"n_layer": 4, "recompute": "selective"}),
    ("dp2-tp2-accumulate-4", 2, 2, {"n_layer": 6, "microbatches": 4, "zero_prefetch": 2}),
    ("dp4-shard-2", 4, 1, {"n_layer": 6, "zero_shard_size": 2}),
    ("dp2-pp2-1f1b", 2, 1, {"n_layer": 8, "pp": 2, "schedule": "1f1b", "microbatches": 4}),
    ("dp2-pp2-interleaved", 2, 1, {"n_layer": 8, "pp": 2, "schedule": "interleaved",
                                   "virtual_stages": 2, "microbatches": 4}),
    ("dp2-pp2-gpipe-untied", 2, 1, {"n_layer": 8, "pp": 2, "schedule": "gpipe",
                                    "microbatches": 2, "tied": False}),
]


def stage3_config(name: str, **train: object) -> Any:
    _, dp, tp, over = next(c for c in STAGE3_CASES if c[0] == name)
    return config(dp, tp, 1, over, **{"steps": STEPS, "zero": 3, "precision": "fp32", **train})


RESUME_STEPS = 4


def resumes(world: World, out: Path) -> dict[str, Any]:
    base = stage3_config("dp4", steps=RESUME_STEPS, eval_every=2)
    got: dict[str, Any] = {"whole": train(base.with_options(run_dir=str(out / "whole")),
                                          world).losses}
    for first, then in ((3, 1), (3, 0), (1, 3)):
        cfg = base.with_options(run_dir=str(out / f"{first}to{then}"))
        before = train(cfg.with_options(zero=first, stop_at=2), world).losses
        after = train(cfg.with_options(zero=then, resume=True), world)
        got[f"{first}to{then}"] = {"losses": before + after.losses, "start": after.start_step}
    return got


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    result: dict[str, Any] = {"rank": world.rank}
    with float64():
        for name, *_ in STAGE3_CASES:
            cfg = stage3_config(name, run_dir=str(out / name))
            r = build_run(cfg, mesh_for(cfg, world))
            assert isinstance(r.weights, Zero3Optimizer)
            units = r.weights.units
            losses, gathered = [], []
            for step in range(1, STEPS + 1):
                units.peak_gathered_bytes = units.gathered_bytes
                losses.append(train_step(r, step).loss)
                gathered.append((units.gathered_bytes, units.peak_gathered_bytes))
            with units.whole():
                local = {n: t.detach().clone() for n, t in r.model.state_dict().items()}
            placements = {n: placement_of(p) for n, p in r.model.named_parameters()}
            result[name] = {
                "losses": losses, "gathered": gathered, "local": local,
                "placements": placements,
                "unit_bytes": [f.numel() * f.element_size() for f in units.full],
                "blocks": [units.full[k].numel() * units.full[k].element_size()
                           for k in units.order],
                "shard_bytes": sum(s.numel() * s.element_size() for s in units.shards),
                "grad_shard_bytes": r.dp.buffer.numel() * r.dp.buffer.element_size(),
                "n_params": sum(p.numel() for p in r.dp.params)}
        result["resume"] = resumes(world, out)
    result["bf16"] = {z: bf16_case(world, z, out / f"bf16-{z}") for z in (1, 3)}
    return result


def bf16_case(world: World, zero: int, out: Path) -> dict[str, Any]:
    """``--precision bf16`` at dp 4 (fp32 main weights, a bf16 model), one microbatch and no
    clipping: ZeRO-1 and ZeRO-3 then do the same arithmetic on the same numbers (each
    element's reduce-scatter sums the same 4 values, AdamW is elementwise, the bf16 weights
    are the rounding of the same fp32 main weights)."""
    cfg = config(4, 1, 1, {"n_layer": 4}, steps=3, zero=zero, precision="bf16",
                 microbatches=1, grad_clip=0.0, run_dir=str(out))
    r = build_run(cfg, mesh_for(cfg, world))
    losses = [train_step(r, step).loss for step in range(1, 4)]
    main = {id(p): p for p in r.weights.values()}
    if isinstance(r.weights, Zero3Optimizer):
        with r.weights.units.whole():
            local = {n: t.detach().clone() for n, t in r.model.state_dict().items()}
    else:
        local = {n: t.detach().clone() for n, t in r.model.state_dict().items()}
    return {"losses": losses, "local": local,
            "main_dtypes": sorted({str(p.dtype) for p in main.values()})}
