"""The kernel variants `make test` runs the numerics tests under really change the sums.

torch's CPU wheel does its matrix products in MKL and its reductions in ATen's own vector
kernels. ``ATEN_CPU_CAPABILITY`` picks ATen's (default = scalar, avx2, avx512); MKL picks its code
path by the CPU and ``MKL_ENABLE_INSTRUCTIONS`` (Intel CPUs only) or ``MKL_CBWR=COMPATIBLE`` (its
SSE2 path, on any x86-64). The models' fp32 linears run in oneDNN (`trainer.model.linear`), which
picks its code path by the CPU up to ``ONEDNN_MAX_CPU_ISA``. If torch stopped honouring them, the
variant runs would repeat the default one and prove nothing: these tests say so.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess

import pytest
import torch

from tests.support import PYTHON

PROBE = """
import json, torch
from trainer.model.linear import linear
g = torch.Generator().manual_seed(0)
a = torch.randn(64, 257, dtype=torch.float64, generator=g)
b = torch.randn(257, 64, dtype=torch.float64, generator=g)
v = torch.randn(100_003, dtype=torch.float32, generator=g)
x = torch.randn(64, 768, generator=g)
w = torch.randn(256, 768, generator=g)
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(),
                  "matmul": (a @ b).flatten().tolist(), "sum": v.sum().item(),
                  "linear": linear(x, w).flatten().tolist()}))
"""


def probe(**env: str) -> dict:
    return _probe(tuple(sorted(env.items())))


@functools.cache
def _probe(env: tuple[tuple[str, str], ...]) -> dict:
    """What PROBE computes in a fresh interpreter with only ``env``'s kernel choices."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("MKL_", "ATEN_CPU_CAPABILITY", "ONEDNN_"))}
    out = subprocess.run([PYTHON, "-c", PROBE], capture_output=True, text=True, timeout=120,
                         env={**clean, "OMP_NUM_THREADS": "1", **dict(env)}, check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_this_run_uses_the_aten_kernels_its_environment_asks_for() -> None:
    asked = os.environ.get("ATEN_CPU_CAPABILITY")
    if asked is None:
        pytest.skip("ATEN_CPU_CAPABILITY is not set: the CPU's best kernels")
    assert torch.backends.cpu.get_cpu_capability().lower() == asked.lower()


def test_mkl_compatible_mode_computes_another_matrix_product() -> None:
    assert probe(MKL_CBWR="COMPATIBLE")["matmul"] != probe()["matmul"]


def test_atens_scalar_kernels_sum_in_another_order() -> None:
    default, best = probe(ATEN_CPU_CAPABILITY="default"), probe()
    if best["capability"] == "DEFAULT":
        pytest.skip("this CPU has no vector kernels for ATen")
    assert default["capability"] == "DEFAULT" and default["sum"] != best["sum"]


def test_onednns_sse41_kernels_compute_another_linear() -> None:
    best = probe()  # this CPU's own choices, whatever this run's environment asks for
    if best["capability"] == "DEFAULT":
        pytest.skip("this CPU has no AVX2: oneDNN has no vector ISA above SSE4.1 to leave")
    assert probe(ONEDNN_MAX_CPU_ISA="SSE41")["linear"] != best["linear"]
