"""One rank of the resume matrix (`tests.support.resume_workers.cases`); returns what it saw.

    mpiexec -n 8 python -m tests.support.mpi_worker tests.support.resume_workers.worker:run OUT

Every layout runs on the first ``ranks`` ranks of the world (a sub-world); the others wait at
a barrier that sleeps instead of spinning, so 8 ranks share 2 cores without starving the ones
that work. For each saved layout (shared between pairs) the members train `SAVED_AT` steps and
save with the trainer's own ``build_run``/``train_step``/``save_checkpoint``; then, for every
pair, a copy of that checkpoint is resumed at the saved layout and at the pair's other layout:
what each rank holds right after the load (its main weights, their placements and AdamW
moments, and the model's parameters), the next `MORE` steps, and a checkpoint at the end.
"""

from __future__ import annotations

import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from tests.support.numerics import float64
from tests.support.resume_workers.cases import MORE, PAIRS, SAVED_AT, WORLD, Layout, Pair
from trainer.comm.bootstrap import World, init
from trainer.comm.mesh import Mesh
from trainer.comm.protocol import Communicator
from trainer.config.options import resolve_dp
from trainer.data.corpus import Corpus, load_corpus
from trainer.training.checkpointing import save_checkpoint
from trainer.training.run import build_run
from trainer.training.step import train_step


def wait_for_all(world: World) -> None:
    """A barrier over the world that sleeps while it waits (MPI's own would spin a core)."""
    request = world.mpi_comm.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


class Ranks:
    """The sub-worlds of the first n ranks, split once (the splits are collective)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.subs = {n: world.comm.split(int(world.rank >= n), world.rank, name=f"first{n}")
                     for n in (1, 2, 4, WORLD)}

    def of(self, layout: Layout) -> Communicator | None:
        return self.subs[layout.ranks] if self.world.rank < layout.ranks else None


def build(pair: Pair, layout: Layout, comm: Communicator, world: World, corpus: Corpus,
          run_dir: Path, **more: object) -> Any:
    cfg = resolve_dp(pair.config(layout, str(run_dir), **more), comm.size)
    return build_run(cfg, Mesh.build(comm, cfg.parallel.mesh(), world.device), corpus)


def save(pair: Pair, ranks: Ranks, corpus: Corpus, run_dir: Path) -> None:
    comm = ranks.of(pair.saved)
    if comm is not None:
        run = build(pair, pair.saved, comm, ranks.world, corpus, run_dir)
        for step in range(1, SAVED_AT + 1):
            train_step(run, step)
        save_checkpoint(run, SAVED_AT)
    wait_for_all(ranks.world)


def resume(pair: Pair, layout: Layout, ranks: Ranks, corpus: Corpus, saved: Path,
           run_dir: Path) -> dict[str, Any] | None:
    """Resume a copy of the checkpoint in ``saved`` at ``layout``: what this rank held right
    after the load, the next steps and where their checkpoint is."""
    if ranks.world.rank == 0:
        shutil.copytree(saved / "checkpoints" / f"step-{SAVED_AT}",
                        run_dir / "checkpoints" / f"step-{SAVED_AT}")
    wait_for_all(ranks.world)
    comm, out = ranks.of(layout), None
    if comm is not None:
        run = build(pair, layout, comm, ranks.world, corpus, run_dir, resume=True)
        optimizer = run.weights.optimizer
        loaded = [(t.detach().clone(), t.placement,
                   {k: v.clone() for k, v in optimizer.state[t].items()})
                  for t in run.weights.values()]
        units = getattr(run.weights, "units", None)  # ZeRO-3: the parameters gathered
        with units.whole() if units is not None else nullcontext():
            params = [(p.detach().clone(), p.placement) for p in run.model.parameters()]
        records = [train_step(run, step) for step in range(SAVED_AT + 1, SAVED_AT + MORE + 1)]
        out = {"start": run.restored.step, "loaded": loaded, "params": params,
               "losses": [r.loss for r in records], "norms": [r.grad_norm for r in records],
               "lrs": [r.lr for r in records],
               "final": str(save_checkpoint(run, SAVED_AT + MORE))}
    wait_for_all(ranks.world)
    return out


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    ranks = Ranks(world)
    corpus = load_corpus(None, cap_bytes=int(0.25 * 2**20))
    result: dict[str, Any] = {"rank": world.rank, "saved": {}, "pairs": {}}
    for pair in PAIRS:
        key = f"{pair.model}-{pair.saved.name}-{'fp64' if pair.fp64 else 'fp32'}"
        with float64() if pair.fp64 else nullcontext():
            if key not in result["saved"]:
                result["saved"][key] = str(out / key)
                save(pair, ranks, corpus, out / key)
                result["pairs"][(key, "reference")] = resume(
                    pair, pair.saved, ranks, corpus, out / key, out / f"{key}-again")
            result["pairs"][(pair.name, "resumed")] = resume(
                pair, pair.resumed, ranks, corpus, out / key, out / pair.name)
    return result
