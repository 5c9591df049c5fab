"""Run the PP training worker once per world size per pytest session and cache what it saw.

A job of 8 ranks on a 2-core machine costs tens of seconds, so every case of one world size
shares one ``mpiexec`` run (see `worker`); its per-rank results, or its failure, are kept here.
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from tests.comm_workers.launch import clean_env, run_mpiexec

TIMEOUT_S = 300
_cache: dict[int, tuple[Path, list[dict[str, Any]] | str]] = {}


def world_results(n: int) -> tuple[Path, list[dict[str, Any]]]:
    """(output dir, what every rank of ``mpiexec -n n ... worker`` saw, by rank)."""
    if n not in _cache:
        out = Path(tempfile.mkdtemp(prefix=f"dtrain-pp-train-world{n}-"))
        atexit.register(shutil.rmtree, out, True)
        done = run_mpiexec(n, [sys.executable, "-m", "tests.pp_training_workers.worker",
                               str(out)], timeout=TIMEOUT_S, env=clean_env())
        if done.returncode != 0:
            _cache[n] = (out, f"worker on {n} ranks exited {done.returncode}:\n"
                              f"{done.stdout[-4000:]}")
        else:
            _cache[n] = (out, [torch.load(out / f"rank{r}.pt", weights_only=False)
                               for r in range(n)])
    out, got = _cache[n]
    if isinstance(got, str):
        raise AssertionError(got)
    return out, got
