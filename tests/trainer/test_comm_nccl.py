"""The Communicator contract on the NCCL backend at world size 1 (one GPU), plus what can be
checked without a GPU: the module imports, and a missing nccl4py is reported with the fix.

The GPU run uses the same worker as the MPI contract (tests/support/comm_workers/contract.py), so
both
backends are held to one set of cases.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

import pytest
import torch

from testbed.mpiexec import PYTHON, REPO, run_mpiexec
from trainer.errors import BootstrapError

WORKER = REPO / "tests" / "support" / "comm_workers" / "contract.py"
HAS_NCCL4PY = importlib.util.find_spec("nccl") is not None


def test_nccl_backend_module_imports_without_nccl4py_or_gpu():
    from trainer.comm.nccl import communicator as backend

    assert backend.NcclCommunicator.backend == "nccl"


@pytest.mark.skipif(HAS_NCCL4PY, reason="nccl4py is installed here")
def test_missing_nccl4py_is_reported_with_the_install_command():
    from trainer.comm.nccl.communicator import import_nccl

    with pytest.raises(BootstrapError, match=r"pip install 'nccl4py\[cu12\]'"):
        import_nccl()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not HAS_NCCL4PY, reason="needs nccl4py (pip install 'nccl4py[cu12]')")
def test_nccl_contract_at_world_size_one_matches_the_serial_results():
    with tempfile.TemporaryDirectory(prefix="dtrain-nccl-") as out:
        proc = run_mpiexec(1, [PYTHON, str(WORKER), "--out", out, "--backend", "nccl"],
                           timeout=300)
        reports = [json.loads(p.read_text()) for p in Path(out).glob("rank*.json")]
    assert reports, proc.stdout[-4000:]
    assert reports[0]["backend"] == "nccl"
    failed = [f"{r['case']}: {r['error']}" for r in reports[0]["records"] if not r["ok"]]
    assert not failed, "\n".join(failed[:10])
    assert proc.returncode == 0, proc.stdout[-4000:]
