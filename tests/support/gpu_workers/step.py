"""Two ranks of the GPU-path tests (`tests.trainer.test_gpu_step`); returns what each rank saw.

    mpiexec -n 2 python -m tests.support.mpi_worker tests.support.gpu_workers.step:run OUT

* ``padding``: a fp64 model whose vocabulary (200) is padded to 256 rows, split over TP = 2:
  the loss, and this rank's gradient rows of the tied embedding.
* ``dp2`` and ``pp2``: three steps of the trainer's own ``run_step`` with 4 microbatches on
  DP = 2 and on PP = 2, the host reads counted in each step (`tests.support.host_syncs`), then the
  steps read together as the training loop reads a logging interval.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.host_syncs import HostSyncs, optimizer_step_counters
from tests.support.numerics import float64
from trainer.comm.bootstrap import World, init
from trainer.comm.mesh import Mesh
from trainer.comm.topology import MeshShape
from trainer.config.options import make_config
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.parallel.tensor.parallelize import parallelize
from trainer.training import readout
from trainer.training.run import build_run, mesh_for
from trainer.training.step import run_step

PADDED = GPTConfig(vocab_size=200, vocab_multiple=256, n_layer=1, n_head=2, d_model=16,
                   seq_len=8)
STEPS = 3


def batch(vocab: int = PADDED.vocab_size) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch whose ids and targets cover the whole real vocabulary's range."""
    gen = torch.Generator().manual_seed(11)
    return (torch.randint(0, vocab, (4, PADDED.seq_len), generator=gen),
            torch.randint(0, vocab, (4, PADDED.seq_len), generator=gen))


def padding_probe(world: World) -> dict[str, Any]:
    mesh = Mesh.build(world.comm, MeshShape(tp=2), world.device)
    with float64():
        model = parallelize(GPT(PADDED, seed=3), mesh.group("tp"))
        x, y = batch()
        loss = model.loss(x, y)
        loss.backward()
    return {"loss": loss.item(), "rows": model.tok_emb.weight.shape[0],
            "start": model.vocab_start, "grad": model.tok_emb.weight.grad.clone()}


def sync_probe(world: World, out: Path, dims: MeshShape) -> dict[str, Any]:
    cfg = make_config({"model": "tiny", "steps": STEPS, "global_batch": 8, "microbatches": 4,
                       "dp": dims.dp, "pp": dims.pp, "lr": 1e-2, "warmup_steps": 1,
                       "data_cap_mb": 0.25, "eval_every": 0, "run_dir": str(out)},
                      {"n_layer": 2, "d_model": 32, "seq_len": 16})
    run = build_run(cfg, mesh_for(cfg, world))
    counts, reads, pending = [], [], []
    for step in range(1, STEPS + 1):
        with HostSyncs(ignore=optimizer_step_counters(run.weights.optimizer)) as syncs:
            pending.append(run_step(run, step))
        counts.append(syncs.count)
        reads.append(syncs.ops)
    with HostSyncs() as syncs:
        records = readout.read(pending)
    return {"counts": counts, "ops": reads, "read_count": syncs.count,
            "pending_is_tensor": [isinstance(p.loss, torch.Tensor) and
                                  isinstance(p.grad_norm, torch.Tensor) for p in pending],
            "losses": [r.loss for r in records], "norms": [r.grad_norm for r in records]}


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    return {"padding": padding_probe(world),
            "dp2": sync_probe(world, out / "dp2", MeshShape(dp=2)),
            "pp2": sync_probe(world, out / "pp2", MeshShape(pp=2))}
