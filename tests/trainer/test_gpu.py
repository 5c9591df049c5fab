"""The GPU path on a real GPU; every test skips cleanly without CUDA.

``python -m bench.gpu`` is run whole (throughput of gpt-124m against the plain loop, the NCCL
contract on every GPU, a ``dtrain launch`` training run): its rows must be complete and its
parts that ran must pass. The speed targets are read from its output by a person (make bench),
not asserted here.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from testbed.mpiexec import REPO, clean_env
from tests.support.host_syncs import HostSyncs
from trainer.gpu.settings import adamw_kernel
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.optim.optimizer import build_optimizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_adamw_is_fused_on_cuda_and_its_step_reads_nothing_on_the_host() -> None:
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=32, seq_len=16)).cuda()
    assert adamw_kernel(list(model.parameters())) == {"fused": True}
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    assert optimizer.defaults["fused"] is True
    idx = torch.randint(0, 256, (2, 16), device="cuda")
    for _ in range(2):
        model.loss(idx, idx).backward()
        with HostSyncs() as syncs:
            optimizer.step()
        assert syncs.ops == []


@pytest.mark.skipif(importlib.util.find_spec("nccl") is None,
                    reason="needs nccl4py (pip install 'nccl4py[cu12]')")
def test_bench_gpu_runs_every_part_and_the_parts_that_ran_pass(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--steps", "5", "--json",
                           str(out)], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())
    speed = [r for r in rows if r["part"] == "throughput"]
    assert [r["compile"] for r in speed] == [False, True]
    for row in speed:
        assert row["model"] == "gpt-124m" and row["seq_len"] == 1024 and row["micro_batch"] >= 1
        assert row["dtrain_tok_s"] > 0 and row["plain_tok_s"] > 0
    launch = next(r for r in rows if r["part"] == "launch")
    assert launch["ok"] and launch["ranks"] == torch.cuda.device_count()
