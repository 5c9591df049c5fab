"""Ranks of `tests.trainer.test_save_start`: how a save agrees on the weights' check and AdamW's
step count, on a real run of 2 ranks (dp 2), in its three forms.

    mpiexec -n 2 python -m tests.support.mpi_worker tests.support.save_agreement_worker:FN OUT

Each starts the same way (`_after_one_step`): after one step, rank 1 makes one of its
parameters infinite and both ranks save step 1, which must raise the divergence on both and
leave no folder; then the parameter is restored and the save is done again.

* `run_begin`: a save's first phase alone (`trainer.training.checkpointing.begin`, its one
  agreement), then written and committed by a `Writer`.
* `run_in_place`: a save waited for (``--no-async-save``) agrees in the one collective after
  the writes (the folder named by the run's token), with no collective before them; saved
  again with rank 1's AdamW step count raised to 5, it commits with the count every rank
  agreed, each rank's record (left in the folder for the leader) removed.
* `run_late`: a background save (``--async-save``) returns at once (nothing is agreed at the
  save's step) and the next step end's poll raises the divergence; saved again as above, it is
  committed moved on by the votes alone; step 2 is saved and finished by ``close`` (settled
  collectively), its records removed too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.layout import committed
from trainer.checkpoint.writer import Writer
from trainer.comm.bootstrap import init
from trainer.config.options import make_config, resolve_dp
from trainer.training.checkpointing import Checkpoints, begin
from trainer.training.guard import DivergedError
from trainer.training.run import build_run, mesh_for
from trainer.training.step import train_step


def _poisoned_after_one_step(out: Path, async_save: bool | None = None
                             ) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    """World, run, the parameter rank 1 made infinite after one step, and its value before."""
    world = init(backend="mpi")
    options: dict[str, Any] = {"model": "tiny", "steps": 2, "global_batch": 4, "dp": 2,
                               "warmup_steps": 1, "data_cap_mb": 0.25, "eval_every": 0,
                               "run_dir": str(out / "run"), "seed": 3}
    if async_save is not None:
        options["async_save"] = async_save
    cfg = resolve_dp(make_config(options, {"n_layer": 1, "d_model": 16, "n_head": 2,
                                           "seq_len": 8}), world.size)
    built = build_run(cfg, mesh_for(cfg, world))
    train_step(built, 1)
    param = next(iter(built.weights.values()))
    kept = param.detach().clone()
    if world.rank == 1:
        with torch.no_grad():
            param.view(-1)[0] = math.inf
    return world, built, param, kept


def _left_then_mended(world: Any, built: Any, param: torch.Tensor, kept: torch.Tensor,
                      root: Path, *, raise_step: bool) -> list[str]:
    """What the leader finds in ``root`` once every rank has raised; then the parameter is
    restored (and, with ``raise_step``, rank 1's AdamW step count raised to 5)."""
    world.mpi_comm.Barrier()  # looked at before any rank saves again
    left = sorted(p.name for p in root.iterdir()) if world.rank == 0 and root.exists() else []
    world.mpi_comm.Barrier()
    with torch.no_grad():
        param.copy_(kept)
    if raise_step and world.rank == 1:
        for state in built.weights.optimizer.state.values():
            state["step"] = torch.tensor(5.0)
    return left


def _refused(save: Callable[[], object]) -> str:
    try:
        save()
    except DivergedError as exc:
        return str(exc)
    return ""


def run_begin(out: Path) -> dict[str, Any]:
    world, built, param, kept = _poisoned_after_one_step(out)
    refused = _refused(lambda: begin(built, 1))
    left = _left_then_mended(world, built, param, kept, out / "run" / "checkpoints",
                             raise_step=False)
    job = begin(built, 1)
    assert job is not None
    writer = Writer(None, background=False)
    writer.submit(job)
    writer.wait()
    return {"refused": refused, "left": left if world.rank == 0 else None,
            "saved": job.final.name,
            "adam_step": job.meta["optimizer"]["step"] if world.rank == 0 else None}


def run_in_place(out: Path) -> dict[str, Any]:
    world, built, param, kept = _poisoned_after_one_step(out, async_save=False)
    saves = Checkpoints(built, world)
    refused = _refused(lambda: saves.save(1))
    root = out / "run" / "checkpoints"
    left = _left_then_mended(world, built, param, kept, root, raise_step=True)
    saves.save(1)
    reports = saves.take_reports()
    saves.close(clean=True)
    meta = json.loads((root / "step-1" / "meta.json").read_text()) if world.rank == 0 else {}
    return {"refused": refused, "left": left, "committed": committed(root / "step-1"),
            "files": sorted(p.name for p in (root / "step-1").iterdir()),
            "adam_step": meta.get("optimizer", {}).get("step"), "reports": reports}


def run_late(out: Path) -> dict[str, Any]:
    world, built, param, kept = _poisoned_after_one_step(out, async_save=True)
    saves = Checkpoints(built, world)
    saves.save(1)  # returns: nothing is agreed at the save's step
    refused = _refused(saves.poll)  # the next step's end reads the agreement
    root = out / "run" / "checkpoints"
    left = _left_then_mended(world, built, param, kept, root, raise_step=True)
    saves.save(1)
    polls = 0
    while saves.writer.save is not None:  # moved on by the votes alone, step end by step end
        saves.writer.join()
        saves.poll()
        polls += 1
    saves.save(2)  # this one is finished by close, which settles it collectively
    saves.poll()
    saves.close(clean=True)
    meta = json.loads((root / "step-1" / "meta.json").read_text()) if world.rank == 0 else {}
    return {"returned": True, "refused": refused, "left": left, "polls": polls,
            "committed": [committed(root / "step-1"), committed(root / "step-2")],
            "files": [sorted(p.name for p in (root / f"step-{n}").iterdir()) for n in (1, 2)],
            "adam_step": meta.get("optimizer", {}).get("step")}
