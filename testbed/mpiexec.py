"""Run a worker under the MPICH wheel's `mpiexec` with a clean environment and a hard timeout.

Hydra's proxy puts every rank in a session of its own, so killing mpiexec's process group would
orphan the ranks. On timeout this helper records mpiexec's descendants by PID first, asks
mpiexec to stop (it forwards SIGTERM to the ranks), then SIGKILLs whatever recorded PID is left.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from testbed.procfs import descendants

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
_CONTRACT_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def mpiexec_path() -> str:
    beside = Path(PYTHON).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpiexec beside the interpreter or on PATH; run `make install`")
    return found


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without another launcher's or job's variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "SLURM_", "DTRAIN_"))
           and k not in _CONTRACT_VARS}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(REPO)
    env.update(extra or {})
    return env


def run_mpiexec(
    n: int, args: Sequence[str], *, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``mpiexec -n N args...`` from the repository root; stdout and stderr together."""
    cmd = [mpiexec_path(), "-n", str(n), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, env=env or clean_env())
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        family = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        time.sleep(2)
        for pid in [*family, proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, _ = proc.communicate()
        raise AssertionError(
            f"{' '.join(cmd)} timed out after {timeout}s; output:\n{out}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def run_python(n: int, args: Sequence[str], *, timeout: float = 300
               ) -> subprocess.CompletedProcess[str]:
    """``mpiexec -n N python args...`` with this interpreter and a clean environment."""
    return run_mpiexec(n, [PYTHON, *args], timeout=timeout, env=clean_env())
