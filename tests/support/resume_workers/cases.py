"""The resume matrix: a checkpoint saved at layout A, resumed at layout B, for pairs that change
every axis a layout has at least once (shared by the MPI worker and the tests).

Each family is one model trained from scratch at its saved layouts for `SAVED_AT` steps, then
resumed for `MORE` steps twice: at the saved layout (the reference) and at the other one. The
dense families run in fp64, as the single-process references of the other parallel tests; the
precision family runs in fp32 (bf16 keeps fp32 main weights whatever the model's dtype).
The expert family keeps dp: the auxiliary loss is Megatron's, over the tokens one rank's
forward sees, so another dp is another sum (not another order of the same sum).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.config.options import TrainConfig, make_config

WORKER = "tests.support.resume_workers.worker:run"
WORLD = 8
SAVED_AT, MORE = 2, 5
LR, GLOBAL_BATCH, SEQ = 3e-3, 16, 8
TRAIN = {"model": "tiny", "steps": SAVED_AT + MORE, "global_batch": GLOBAL_BATCH, "lr": LR,
         "warmup_steps": 1, "seed": 3, "data_cap_mb": 0.25, "bucket_size": 2000,
         "microbatches": 2, "grad_clip": 1.0, "eval_every": 0, "precision": "fp32"}
MODELS = {"dense": {"n_layer": 2, "n_head": 4, "d_model": 16, "seq_len": SEQ},
          "deep": {"n_layer": 8, "n_head": 4, "d_model": 16, "seq_len": SEQ},
          "moe": {"n_layer": 2, "n_head": 4, "d_model": 16, "seq_len": SEQ, "moe_experts": 4,
                  "moe_topk": 2}}


@dataclass(frozen=True)
class Layout:
    """A layout (options) and the ranks it takes."""

    name: str
    options: dict = field(default_factory=dict)

    @property
    def ranks(self) -> int:
        o = self.options
        return o.get("dp", 1) * o.get("tp", 1) * o.get("pp", 1) * o.get("cp", 1)


@dataclass(frozen=True)
class Pair:
    """Saved at ``saved``, resumed at ``resumed``; ``model``: a key of `MODELS`."""

    name: str
    model: str
    saved: Layout
    resumed: Layout
    fp64: bool = True

    def config(self, layout: Layout, run_dir: str, **more: object) -> TrainConfig:
        return make_config({**TRAIN, **layout.options, "run_dir": run_dir, **more},
                           MODELS[self.model])


PP = {"schedule": "1f1b", "microbatches": 4}
DP2, DP4 = Layout("dp2", {"dp": 2}), Layout("dp4-zero1", {"dp": 4, "zero": 1})
MOE = Layout("dp4-ep2", {"dp": 4, "ep": 2})
FP32, BF16 = Layout("dp2-fp32", {"dp": 2}), Layout("dp2-bf16", {"dp": 2, "precision": "bf16"})
THREE_D = Layout("2x2x2", {"dp": 2, "tp": 2, "pp": 2, **PP})
DP4_ZERO3 = Layout("dp4-zero3", {"dp": 4, "zero": 3})
PAIRS = [
    Pair("dp2-to-dp4-zero1", "dense", DP2, DP4),
    Pair("dp4-zero1-to-dp1", "dense", DP4, Layout("dp1", {"dp": 1})),
    Pair("tp2-to-tp1", "dense", Layout("tp2", {"dp": 1, "tp": 2}), Layout("tp1", {"dp": 1})),
    Pair("tp1-to-tp4", "dense", Layout("serial", {"dp": 1}), Layout("tp4", {"dp": 1, "tp": 4})),
    # cp is a layout: the parameters are replicated over it, so only who writes what changes
    Pair("cp2-to-cp1", "dense", Layout("cp2", {"dp": 1, "cp": 2}), Layout("serial", {"dp": 1})),
    Pair("cp1-to-cp4", "dense", Layout("serial", {"dp": 1}), Layout("cp4", {"dp": 1, "cp": 4})),
    Pair("pp2-to-pp4-interleaved", "deep", Layout("pp2", {"dp": 1, "pp": 2, **PP}),
         Layout("pp4-v2", {"dp": 1, "pp": 4, **PP, "schedule": "interleaved",
                           "virtual_stages": 2})),
    Pair("pp-layers-changed", "deep", Layout("pp2", {"dp": 1, "pp": 2, **PP}),
         Layout("pp2-layers-2-6", {"dp": 1, "pp": 2, **PP, "pp_layers": "2,6"})),
    Pair("ep2-to-ep4", "moe", MOE, Layout("dp4-ep4", {"dp": 4, "ep": 4})),
    Pair("ep2-to-ep1", "moe", MOE, Layout("dp4-ep1", {"dp": 4})),
    Pair("bf16-to-fp32", "dense", BF16, FP32, fp64=False),
    Pair("fp32-to-bf16", "dense", FP32, BF16, fp64=False),
    Pair("2x2x2-to-1x4x1", "dense", THREE_D, Layout("1x4x1", {"dp": 1, "tp": 4})),
    Pair("2x2x2-zero2-to-dp4-zero2", "dense",
         Layout("2x2x2-zero2", {**THREE_D.options, "zero": 2}),
         Layout("dp4-zero2", {"dp": 4, "zero": 2})),
    # ZeRO-3 (parameters sharded in units) to and from other stages, layouts and shard sizes
    Pair("dp2-zero3-to-dp2-zero1", "dense", Layout("dp2-zero3", {"dp": 2, "zero": 3}),
         Layout("dp2-zero1", {"dp": 2, "zero": 1})),
    Pair("dp4-zero1-to-dp4-zero3", "dense", DP4, DP4_ZERO3),
    Pair("dp2xtp2-zero3-to-dp4-zero3", "dense",
         Layout("dp2-tp2-zero3", {"dp": 2, "tp": 2, "zero": 3}), DP4_ZERO3),
    # ZeRO-2/3 under cp shard over dp x cp: saved sharded over 4 ranks of which 2 are cp
    Pair("cp2xdp2-zero3-to-dp4-zero1", "dense",
         Layout("cp2-dp2-zero3", {"dp": 2, "cp": 2, "zero": 3}), DP4),
    Pair("dp4-zero1-to-cp2xdp2-zero2", "dense", DP4,
         Layout("cp2-dp2-zero2", {"dp": 2, "cp": 2, "zero": 2})),
    Pair("zero3-shard2-to-shard4", "dense",
         Layout("dp4-zero3-shard2", {"dp": 4, "zero": 3, "zero_shard_size": 2}),
         Layout("dp4-zero3-shard4", {"dp": 4, "zero": 3, "zero_shard_size": 4})),
]
