"""One MPI run per (rank function, world size) per pytest session, shared by every test.

Starting a 4- or 8-rank job costs seconds to tens of seconds on a 2-core machine, so a test
module gathers everything its ranks must compute into one rank function and every test reads
the cached per-rank results. A failed run is cached too: each test that asks re-raises it with
the run's output instead of starting the job again.

The ranks are real MPICH processes started by `mpiexec`, each forked from one server that
imported torch once for the session (`testbed.forkserver`) instead of importing it again.
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from testbed.forkserver import ForkServer
from testbed.mpiexec import clean_env, run_mpiexec

TIMEOUT_S = 300


@dataclass(frozen=True)
class WorldRun:
    out: Path                   # the run's folder (files the ranks wrote besides their results)
    ranks: list[dict[str, Any]]  # what each rank's function returned, by rank


_runs: dict[tuple[str, int], WorldRun | str] = {}
_server: list[ForkServer] = []  # started by the first run, stopped when the session ends


def world_run(target: str, n: int) -> WorldRun:
    """``target`` ("module:function", see `tests.support.mpi_worker`) on ``n`` MPI ranks, once."""
    key = (target, n)
    if key not in _runs:
        _runs[key] = _run(target, n)
    got = _runs[key]
    if isinstance(got, str):
        raise AssertionError(got)
    return got


def _run(target: str, n: int) -> WorldRun | str:
    out = Path(tempfile.mkdtemp(prefix=f"dtrain-{target.rsplit('.', 1)[-1]}-world{n}-"))
    atexit.register(shutil.rmtree, out, True)
    command = ["-m", "tests.support.mpi_worker", target, str(out)]
    done = run_mpiexec(n, _fork_server().command(command),
                       timeout=TIMEOUT_S, env=clean_env())
    if done.returncode != 0:
        return f"{target} on {n} ranks exited {done.returncode}:\n{done.stdout[-4000:]}"
    return WorldRun(out, [torch.load(out / f"rank{r}.pt", weights_only=False)
                          for r in range(n)])


def run_ranks(n: int, args: list[str], *, timeout: float = TIMEOUT_S
              ) -> subprocess.CompletedProcess[str]:
    """``mpiexec -n N python args...`` (e.g. ``["-m", "trainer.train", ...]``), each rank forked
    from the session's fork server; stdout and stderr together, as `run_python` returns them."""
    return run_mpiexec(n, _fork_server().command(args), timeout=timeout, env=clean_env())


def forked_python() -> list[str]:
    """What to run instead of ``python`` for a rank or a process of the trainer on this machine
    (``dtrain launch --nproc-per-node N -- <this> -m trainer.train ...``, or a plain
    subprocess): a stub whose fork of the session's server becomes the process, torch already
    imported. What its parent sees (stdio, ``PMI_FD``, signals, exit status) is the fork's, so
    the launcher handles it as any rank. Not for ranks on namespace hosts (the fork runs in this
    network namespace) nor where a test inspects the rank's process itself."""
    return _fork_server().command([])


def _fork_server() -> ForkServer:
    if not _server:
        _server.append(ForkServer(clean_env()))
        atexit.register(_server[0].close)
    return _server[0]
