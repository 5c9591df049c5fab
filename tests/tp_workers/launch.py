"""Run the TP worker once per world size per pytest session, for both TP test modules.

Starting a 4-rank job costs seconds on a 2-core machine, so the layer probes and the training
layouts of one world size share one ``mpiexec`` run; its per-rank results (or its failure) are
cached here and handed to every test that asks for that world size.
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
_cache: dict[int, list[dict[str, Any]] | str] = {}


def world_results(n: int) -> list[dict[str, Any]]:
    """What every rank of ``mpiexec -n n python -m tests.tp_workers.worker`` saw, by rank."""
    if n not in _cache:
        out = Path(tempfile.mkdtemp(prefix=f"dtrain-tp-world{n}-"))
        atexit.register(shutil.rmtree, out, True)
        done = run_mpiexec(n, [sys.executable, "-m", "tests.tp_workers.worker", str(out)],
                           timeout=TIMEOUT_S, env=clean_env())
        if done.returncode != 0:
            _cache[n] = f"worker on {n} ranks exited {done.returncode}:\n{done.stdout[-4000:]}"
        else:
            _cache[n] = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(n)]
    got = _cache[n]
    if isinstance(got, str):
        raise AssertionError(got)
    return got
