"""One rank of the context-parallel training tests (`tests.trainer.test_context_parallel_training`).

    mpiexec -n N python -m tests.support.mpi_worker tests.support.cp_workers.training:run OUT

Trains every run of `RUNS[N]` in fp64 with the trainer's own ``build_run``/``train_step`` (the
mesh, the data loader's zig-zag chunks, the models' context-parallel attention, the loss over dp
and cp) and returns the losses, gradient norms and this rank's parameters with their tensor-
parallel cut; world 1 is the single-process model of each family. The ``-docs`` runs train on
a packed dataset of short documents (`tests.support.documents`, written by each rank alike)
with ``--document-mask``, world 1 being the single-process masked model.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.support.documents import write_documents
from tests.support.numerics import float64
from tests.support.serial_reference import train_serially
from trainer.comm.bootstrap import init
from trainer.config.options import TrainConfig, make_config
from trainer.data.corpus import load_corpus
from trainer.parallel.tensor import shard_spec
from trainer.parallel.zero import Zero3Optimizer
from trainer.training.run import Run as RunState
from trainer.training.run import build_run, mesh_for
from trainer.training.step import train_step

WORKER = "tests.support.cp_workers.training:run"
STEPS = 5
GLOBAL_BATCH = 4
SEQ_LEN = 32
"""Divides 2 x cp x tp for cp 4 (chunks of 4 tokens) and for cp 2 x tp 2 with sequence
parallelism (8 tokens per cp rank, 4 per tp rank)."""
FAMILIES = {"gpt": {"model": "tiny", "seq_len": SEQ_LEN},  # 2 heads of 32, 2 layers
            "llama": {"model": "llama-tiny", "seq_len": SEQ_LEN},  # 8 heads, 2 kv heads
            "gpt4": {"model": "tiny", "seq_len": SEQ_LEN, "n_layer": 4},  # pp 2 x 2 chunks
            # SwiGLU experts, dropless; no load-balancing loss: it is taken over each rank's
            # tokens (as under dp), so with it a split run is another objective
            "moe": {"model": "llama-tiny", "seq_len": SEQ_LEN, "moe_experts": 4, "moe_topk": 2,
                    "moe_aux_loss_coeff": 0.0}}
DENSE = ("gpt", "llama")
DOCUMENT_TOKENS = 8000
"""The packed documents' dataset: 240 windows of 33 tokens, each with 3 to 5 documents."""
TRAIN = {"steps": STEPS, "global_batch": GLOBAL_BATCH, "microbatches": 2, "lr": 3e-3,
         "warmup_steps": 1, "seed": 11, "data_cap_mb": 0.25, "grad_clip": 0.5, "eval_every": 0}


@dataclass(frozen=True)
class Run:
    name: str
    family: str
    layout: dict[str, Any] = field(default_factory=dict)

    @property
    def documents(self) -> bool:
        """Trained on packed documents with document masking."""
        return self.name.endswith("-docs")

    @property
    def packed(self) -> bool:
        """Trained on the packed documents (masked, or causal over the window: ``-packed``)."""
        return self.documents or self.name.endswith("-packed")

    @property
    def serial(self) -> str:
        """The single-process run this one must match."""
        return f"serial-{self.family}" + ("-docs" if self.documents else "")

    def config(self, run_dir: str, world: int, documents: Path) -> TrainConfig:
        ranks = self.layout.get("tp", 1) * self.layout.get("pp", 1) * self.layout.get("cp", 1)
        data = {"data": str(documents), "document_mask": self.documents} if self.packed else {}
        return make_config({**TRAIN, **self.layout, **data, "dp": world // ranks,
                            "run_dir": run_dir}, FAMILIES[self.family])


RING, GATHER = {"cp_comm": "ring"}, {"cp_comm": "allgather"}
DOCS = ("", "-docs")
"""Causal over the window, and masked by documents."""
RUNS: dict[int, list[Run]] = {
    1: [*(Run(f"serial-{family}", family) for family in FAMILIES),
        *(Run(f"serial-{family}{docs}", family) for family in DENSE
          for docs in ("-docs", "-packed"))],
    2: [Run(f"cp2-{family}-{comm['cp_comm']}{docs}", family, {"cp": 2, **comm})
        for family in DENSE for comm in (RING, GATHER) for docs in DOCS],
    4: [*(Run(f"cp4-{family}-{comm['cp_comm']}{docs}", family, {"cp": 4, **comm})
          for family in DENSE for comm in (RING, GATHER) for docs in DOCS),
        Run("cp2-dp2-ep2-moe", "moe", {"cp": 2, "ep": 2}),
        Run("cp2-tp2-sp-llama", "llama", {"cp": 2, "tp": 2, "sequence_parallel": True}),
        Run("cp2-pp2-gpt", "gpt", {"cp": 2, "pp": 2, "schedule": "1f1b"}),
        Run("cp2-pp2-interleaved-gpt4", "gpt4", {"cp": 2, "pp": 2, "schedule": "interleaved",
                                                 "virtual_stages": 2, **GATHER}),
        Run("cp2-dp2-zero1-llama", "llama", {"cp": 2, "zero": 1}),
        Run("cp2-dp2-zero2-gpt", "gpt", {"cp": 2, "zero": 2}),
        Run("cp2-dp2-zero3-llama", "llama", {"cp": 2, "zero": 3}),
        Run("cp2-dp2-selective-gpt", "gpt", {"cp": 2, "recompute": "selective"}),
        Run("cp2-dp2-full-llama", "llama", {"cp": 2, "recompute": "full", **GATHER}),
        Run("cp2-tp2-sp-llama-docs", "llama", {"cp": 2, "tp": 2, "sequence_parallel": True}),
        Run("cp2-pp2-gpt-docs", "gpt", {"cp": 2, "pp": 2, "schedule": "1f1b"}),
        Run("cp2-dp2-selective-gpt-docs", "gpt", {"cp": 2, "recompute": "selective"}),
        Run("cp2-dp2-full-llama-docs", "llama", {"cp": 2, "recompute": "full", **GATHER})],
}


def whole_parameters(state: RunState) -> dict[str, torch.Tensor]:
    """This rank's parameters (its tensor-parallel shards), gathered whole under ZeRO-3."""
    gathered = state.weights.units.whole() if isinstance(state.weights, Zero3Optimizer) \
        else nullcontext()
    with gathered:
        return {n: p.detach().clone() for n, p in state.model.named_parameters()}


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    result: dict[str, Any] = {}
    documents = write_documents(out / f"documents-{world.rank}", DOCUMENT_TOKENS)
    with float64():
        for r in RUNS[world.size]:
            cfg = r.config(str(out / r.name), world.size, documents)
            corpus = None if r.packed else \
                load_corpus(cfg.data.path, cap_bytes=int(cfg.data.data_cap_mb * 2**20))
            mesh = mesh_for(cfg, world)
            state = build_run(cfg, mesh, corpus)
            records = [train_step(state, step) for step in range(1, STEPS + 1)]
            if world.size == 1:  # the references: their gradients' measured scale too
                result[f"{r.name}/grad_scale"] = train_serially(cfg, STEPS)["grad_scale"]
            result[r.name] = {
                "losses": [rec.loss for rec in records],
                "norms": [rec.grad_norm for rec in records],
                "tp_rank": mesh.rank("tp"), "tp": mesh.size("tp"),
                "params": whole_parameters(state),
                "specs": {n: shard_spec(p) for n, p in state.model.named_parameters()}}
    return result
