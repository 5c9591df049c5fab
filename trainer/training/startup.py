"""Start-up of ``python -m trainer.train``: every check of the user's input runs before training,
and a failure is printed once per job, not once per rank.

Two phases, each ended by `agree` on ``MPI_COMM_WORLD`` (an allgather of every rank's failure,
or None):

1. the options: argparse, the TOML file, `trainer.config.options` validation (including whether the
   model splits over ``--tp`` and ``--pp``), and the run dir (`trainer.checkpoint.run_dir`).
   Only rank 0 (``RANK``/``PMI_RANK`` of the environment) lets argparse print usage and help;
   the other ranks parse quietly.
2. the world and the data (`prepare`): joining the job, the layout against the number of ranks,
   reading the data (a host may lack it), the vocabulary against the data's bytes, both splits
   large enough for a window; then (`same_data`) every rank read the same bytes. Files that
   look binary are only warned about (by rank 0).

When an agreement finds a failure, the lowest failing rank prints its message (prefixed with
its rank when other ranks did not fail), every rank waits at a barrier until it is out, and all
exit with the failure's code after a normal ``MPI_Finalize``: no ``MPI_Abort`` and its noise
on every rank. Errors later, in training, can hit one rank while the others are inside a
collective; `fail_alone` then prints and calls ``MPI_Abort``, and the launcher stops the rest.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from trainer.comm.bootstrap import World, import_mpi, init
from trainer.comm.protocol import Communicator, ReduceOp
from trainer.config.options import TrainConfig, parse_args, resolve_dp
from trainer.data.corpus import Corpus
from trainer.data.sources import TokenData, read_data
from trainer.errors import BootstrapError, TrainerError
from trainer.training import restart
from trainer.training.resume import check_run_dir

T = TypeVar("T")
#: Where launchers put the global rank: dtrain and torchrun, MPICH, Open MPI.
RANK_VARIABLES = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")


@dataclass(frozen=True)
class Failure:
    """A failed phase on one rank: what to print ("" when already printed) and the exit code."""

    message: str
    code: int


def env_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank as its launcher set it, before MPI is up (0 when unset)."""
    env = os.environ if environ is None else environ
    for name in RANK_VARIABLES:
        if env.get(name, "").isdigit():
            return int(env[name])
    return 0


def attempt(phase: Callable[[], T]) -> tuple[T | None, Failure | None]:
    """Run a phase; a failure is returned, not raised, so that every rank reaches `agree`."""
    try:
        return phase(), None
    except TrainerError as exc:
        return None, Failure(f"error: {exc}", 2)
    except SystemExit as exc:  # argparse: usage or help, printed by rank 0 only
        code = exc.code if isinstance(exc.code, int) else 2
        return None, Failure("", code)
    except Exception as exc:  # noqa: BLE001 - reported like the others, once
        return None, Failure(f"{traceback.format_exc()}error: unexpected "
                             f"{type(exc).__name__}: {exc}", 1)


def world_comm() -> Any:
    """mpi4py's COMM_WORLD, or None when MPI cannot start (phase 2 then reports why)."""
    try:
        return import_mpi().COMM_WORLD
    except BootstrapError:
        return None


def agree(comm: Any, failure: Failure | None) -> Failure | None:
    """Collective over ``comm`` (mpi4py-like; None: this process alone): the failure of the
    lowest failing rank, on every rank, printed by that rank only; None when all succeeded."""
    if comm is None:
        if failure is not None and failure.message:
            print(failure.message, file=sys.stderr, flush=True)
        return failure
    failures = comm.allgather(failure)
    failed: list[tuple[int, Failure]] = [(rank, f) for rank, f in enumerate(failures)
                                         if f is not None]
    if not failed:
        return None
    first_rank, first = failed[0]
    if comm.Get_rank() == first_rank and first.message:
        alone = len(failed) < comm.Get_size()
        print((f"[rank {first_rank}] " if alone else "") + first.message, file=sys.stderr,
              flush=True)
    comm.Barrier()  # nobody exits (so the launcher stops nobody) before the message is out
    return first


def start(argv: Sequence[str] | None
          ) -> tuple[World, TrainConfig, Corpus | TokenData] | int:
    """Both phases with their agreements: what to train with, or the exit code of bad input."""
    quiet = env_rank() != 0
    restarted = restart.of_environ(os.environ)  # a restarted round resumes by itself
    cfg, failed = attempt(lambda: check_run_dir(restart.resuming(parse_args(argv, quiet=quiet),
                                                                 restarted)))
    failed = agree(world_comm(), failed)
    if failed is None:
        ready, failed = attempt(lambda: prepare(cast(TrainConfig, cfg)))
        failed = agree(world_comm(), failed)
    if failed is None:
        failed = agree(world_comm(), same_data(world_comm(), cast(tuple[Any, ...], ready)[2]))
    return cast(tuple[World, TrainConfig, Corpus | TokenData], ready) if failed is None \
        else failed.code


def same_data(comm: Any, corpus: Corpus | TokenData) -> Failure | None:
    """Collective over ``comm``: a failure on every rank when the ranks read different bytes
    (e.g. a --data folder that differs between hosts), naming the ranks of each version."""
    if comm is None:
        return None
    seen = comm.allgather((corpus.fingerprint, corpus.source))
    if len(set(seen)) == 1:
        return None
    ranks = {version: [r for r, v in enumerate(seen) if v == version] for version in seen}
    where = "; ".join(f"{source} = {fp} on rank(s) {', '.join(map(str, rs))}"
                      for (fp, source), rs in ranks.items())
    return Failure(f"error: ranks read different training data [{where}]: every rank must "
                   "train on the same bytes. Give every host the same --data (or the same "
                   "Python for the default corpus)", 2)


def prepare(cfg: TrainConfig) -> tuple[World, TrainConfig, Corpus | TokenData]:
    """Phase 2 on this rank: join the world, fit the layout to it, read and check the data."""
    world = init(backend=cfg.backend)
    cfg = resolve_dp(*restart.fit_world(cfg, world.size, restart.of_environ(os.environ)))
    return world, cfg, training_data(cfg)


def training_data(cfg: TrainConfig) -> Corpus | TokenData:
    """The run's data (text, or tokenized datasets: `trainer.data.sources`), refused when the
    model or the splits cannot use it."""
    return read_data(cfg.data.path, vocab_size=cfg.gpt.vocab_size, seq_len=cfg.gpt.seq_len,
                     val_fraction=cfg.data.val_fraction, documents=cfg.data.document_mask,
                     cap_mb=cfg.data.data_cap_mb, validation=cfg.logging.eval_every > 0)


def require_same(comm: Communicator, value: int, device: torch.device, what: str,
                  where: str, fix: str) -> None:
    """Fail on every rank together when ``value`` differs between ranks (max == min test)."""
    probe = torch.tensor([value, -value], dtype=torch.int64, device=device)
    comm.all_reduce(probe, ReduceOp.MAX)
    if int(probe[0]) != value or -int(probe[1]) != value:
        raise TrainerError(what, where, "the value differs between ranks", fix)


def binary_warning(corpus: Corpus | TokenData) -> str:
    """The warning about files that look binary ("" when there are none)."""
    files = corpus.binary_files
    if not files:
        return ""
    shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return (f"warning: binary data in the training text [{shown}]: {len(files)} file(s) have "
            "NUL bytes or are not UTF-8, and the model will learn their raw bytes. Leave them "
            "out of --data unless that is intended")


def fail_alone(world: World | None, message: str, code: int,
               exc: TrainerError | None = None) -> int:
    """A failure during training: print it, then abort the job (other ranks may be inside a
    collective that this rank will never join). An error every rank raised together
    (`TrainerError.everywhere`) is printed by its reporting rank only and needs no abort."""
    many = world is not None and world.size > 1
    agreed = exc is not None and exc.agreed
    if not agreed or (exc is not None and exc.report):
        print((f"[rank {world.rank}] " if many and world else "") + message, file=sys.stderr,
              flush=True)
    if many and world is not None and not agreed:
        world.mpi_comm.Abort(code)
    return code
