"""One rank of the Llama layout tests (`tests.trainer.test_llama_training`).

    mpiexec -n N python -m tests.support.mpi_worker tests.support.llama_workers.training:run OUT

Trains every run of `RUNS[N]` (the Llama with grouped-query attention, 8 query and 2 key/value
heads) in fp64 with the trainer's own ``build_run``/``train_step`` and returns the losses and
this rank's parameters with their tensor-parallel cut; world 1 is the single-process model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.numerics import float64
from trainer.comm.bootstrap import init
from trainer.config.options import TrainConfig, make_config
from trainer.construction import build_rank_model
from trainer.data.corpus import load_corpus
from trainer.parallel.tensor import shard_spec
from trainer.training.run import build_run, mesh_for
from trainer.training.step import train_step

WORKER = "tests.support.llama_workers.training:run"
STEPS = 3
GLOBAL_BATCH = 8
MODEL = {"model": "llama-tiny", "seq_len": 16}  # 8 heads, 2 kv heads, d_model 64, 2 layers
TRAIN = {"steps": STEPS, "global_batch": GLOBAL_BATCH, "microbatches": 2, "lr": 3e-3,
         "warmup_steps": 1, "seed": 7, "data_cap_mb": 0.25, "grad_clip": 0.5, "eval_every": 0}


@dataclass(frozen=True)
class Run:
    name: str
    layout: dict[str, Any] = field(default_factory=dict)
    serial: str = "serial"
    """The single-process run this one must match."""
    model: dict[str, Any] = field(default_factory=dict)

    def config(self, run_dir: str, world: int) -> TrainConfig:
        dp = world // (self.layout.get("tp", 1) * self.layout.get("pp", 1))
        return make_config({**TRAIN, **self.layout, "dp": dp, "run_dir": run_dir},
                           {**MODEL, **self.model})


CONSTRUCTED_SEED = 5
PP = {"pp": 2, "schedule": "1f1b"}
FOUR_LAYERS = {"n_layer": 4}  # pp 2 x 2 virtual stages: one layer per chunk
# No load-balancing loss: it is computed per DP rank's tokens (Megatron's rule), so with it a
# dp 2 run is another objective than the single process's, not the same one summed otherwise.
MOE = {"moe_experts": 4, "moe_topk": 2, "moe_aux_loss_coeff": 0.0}
RUNS: dict[int, list[Run]] = {
    1: [Run("serial"), Run("serial-4-layers", model=FOUR_LAYERS), Run("serial-moe", model=MOE)],
    4: [Run("tp4-sp", {"tp": 4, "sequence_parallel": True}),  # kv heads replicated (2 < 4)
        Run("tp2pp2-interleaved-full", {"tp": 2, "pp": 2, "schedule": "interleaved",
                                        "virtual_stages": 2, "recompute": "full"},
            "serial-4-layers", FOUR_LAYERS),
        Run("dp2tp2ep2-moe", {"tp": 2, "ep": 2}, "serial-moe", MOE)],  # SwiGLU experts
    8: [Run("dp2tp2pp2", {"tp": 2, **PP}),
        Run("dp2tp2pp2-zero1", {"tp": 2, **PP, "zero": 1}),
        Run("dp2tp2pp2-zero1-sp", {"tp": 2, **PP, "zero": 1, "sequence_parallel": True}),
        Run("dp2tp2pp2-gpipe-selective", {"tp": 2, "pp": 2, "schedule": "gpipe",
                                          "recompute": "selective"})],
}


def construct(world: Any) -> dict[str, Any]:
    """This rank's model of `CONSTRUCTED` built per rank on the meta device at tp = world."""
    cfg = make_config(TRAIN, MODEL).gpt
    model = build_rank_model(cfg, CONSTRUCTED_SEED, device=world.device, tp=world.comm)
    return {"tp_rank": world.rank,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "specs": {n: shard_spec(p) for n, p in model.named_parameters()}}


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    result: dict[str, Any] = {"constructed": construct(world)}
    with float64():
        for r in RUNS[world.size]:
            cfg = r.config(str(out / r.name), world.size)
            corpus = load_corpus(cfg.data.path, cap_bytes=int(cfg.data.data_cap_mb * 2**20))
            mesh = mesh_for(cfg, world)
            state = build_run(cfg, mesh, corpus)
            losses = [train_step(state, step).loss for step in range(1, STEPS + 1)]
            result[r.name] = {
                "losses": losses, "tp_rank": mesh.rank("tp"), "tp": mesh.size("tp"),
                "params": {n: p.detach().clone() for n, p in state.model.named_parameters()},
                "specs": {n: shard_spec(p) for n, p in state.model.named_parameters()}}
    return result
