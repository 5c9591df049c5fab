"""A rank of a restarted job (`dtrain launch --max-restarts`): resume by itself, on the world
it was given.

The launcher gives every round's ranks ``DTRAIN_RESTART_COUNT`` (0 in the first round), and
from the first restart on the cause and the first round's ``WORLD_SIZE`` (`workerenv`). Then:

* the run resumes from the newest committed checkpoint that verifies, as ``--resume
  --resume-fallback`` does (`trainer.training.resume`), or starts at step 0 when there is none
  yet. Batches, dropout seeds and the learning-rate schedule follow from the step alone, so
  the losses after the resumed step are those of an uninterrupted run.
* rank 0 says once ``resumed at step S after restart K (cause: ...)``.
* when the world is smaller than the first round's (`--min-nodes` left hosts out), dp shrinks
  and the global batch stays: a rank takes a larger share of it, in more microbatches, none
  larger than the first round's (so memory per microbatch does not grow). dp is the largest
  that fits the ranks, divides the global batch and passes every other check of the layout;
  the microbatches are the fewest that divide the rank's share without growing. Ranks beyond
  dp x tp x pp stand by: they join the world, split it, and leave (MPI_Finalize then waits,
  asleep, for the others). When no dp fits, the run is refused with one error.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace

import workerenv
from trainer.comm.bootstrap import World
from trainer.config.options import TrainConfig
from trainer.errors import ConfigError


@dataclass(frozen=True)
class Restart:
    count: int
    """How many times the job was restarted (>= 1)."""
    cause: str
    """What ended the previous round, as the launcher words it."""
    initial_world: int
    """WORLD_SIZE of the first round."""


def of_environ(environ: Mapping[str, str]) -> Restart | None:
    """The restart this process runs in; None in a first round or outside `dtrain launch`."""
    count = environ.get(workerenv.RESTART_COUNT, "0")
    if not count.isdigit() or int(count) == 0:
        return None
    initial = environ.get(workerenv.INITIAL_WORLD_SIZE, "")
    world = environ.get(workerenv.WORLD_SIZE, "1")
    return Restart(int(count), environ.get(workerenv.RESTART_CAUSE, "") or "unknown",
                   int(initial) if initial.isdigit() else int(world))


def resuming(cfg: TrainConfig, restart: Restart | None) -> TrainConfig:
    """Under a restart the run resumes whatever the command line says."""
    if restart is None:
        return cfg
    return cfg.with_options(resume=True, resume_fallback=True)


def fit_world(cfg: TrainConfig, world_size: int, restart: Restart | None
              ) -> tuple[TrainConfig, int]:
    """(the config, how many ranks train): unchanged unless a restart left fewer ranks than
    the first round had (see the module docstring for the rule)."""
    if restart is None or world_size >= restart.initial_world:
        return cfg, world_size
    par, batch = cfg.parallel, cfg.data.global_batch
    model = par.tp * par.pp * par.cp  # the ranks of one model copy: a sequence's too
    first_dp = par.dp or restart.initial_world // model
    largest = max(1, batch // (first_dp * par.microbatches))  # samples/microbatch
    problems = []
    for dp in range(min(first_dp, world_size // model), 0, -1):
        if batch % dp:
            continue
        share = batch // dp
        microbatches = next(k for k in range(-(-share // largest), share + 1) if share % k == 0)
        try:
            fitted = cfg.with_options(dp=dp, microbatches=microbatches)
        except ConfigError as exc:  # e.g. a size that no longer divides dp, a pipeline schedule
            problems.append(f"dp {dp}: {exc.why}")
            continue
        return fitted, dp * model
    raise ConfigError(
        "the layout does not fit the smaller world",
        f"restart {restart.count}: {world_size} of {restart.initial_world} ranks",
        f"one model copy takes tp*pp{'*cp' if par.cp > 1 else ''} = {model} ranks and dp must "
        f"divide the global batch "
        f"{batch}" + (f" ({'; '.join(problems)})" if problems else ""),
        "Give the job a spare host (`spare` in the hostfile or --spares K), or a --min-nodes "
        "that keeps enough hosts for the layout")


def active_world(world: World, cfg: TrainConfig) -> World | None:
    """The world of the ranks that train (collective: every rank calls it); None on a rank
    that stands by (it says so and leaves)."""
    par = cfg.parallel
    active = par.dp * par.tp * par.pp * par.cp
    if active == world.size:
        return world
    training = world.rank < active
    comm = world.comm.split(0 if training else 1, world.rank, name="active")
    mpi_comm = world.mpi_comm.Split(0 if training else 1, world.rank)  # for the SIGTERM vote
    if not training:
        print(f"dtrain: rank {world.rank} stands by: {par.describe(' x ')} "
              f"uses {active} of the {world.size} ranks", file=sys.stderr, flush=True)
        return None
    return replace(world, size=active, comm=comm, mpi_comm=mpi_comm)


def announcement(restart: Restart | None, start_step: int) -> str:
    """What rank 0 prints once a restarted run has loaded its checkpoint ("" otherwise)."""
    if restart is None:
        return ""
    if not start_step:
        return (f"dtrain: restarted at step 0 after restart {restart.count} (no checkpoint "
                f"yet; cause: {restart.cause})")
    return (f"dtrain: resumed at step {start_step} after restart {restart.count} "
            f"(cause: {restart.cause})")
