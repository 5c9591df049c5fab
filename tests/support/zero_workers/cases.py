"""The ZeRO-1 cases, shared by the MPI worker and the tests.

Tiny models, 3 steps (4 for the resume runs); the global batch of 8 sequences divides by every
dp in {1, 2, 4}. Buckets are small so each rank's shard cuts through parameters and a bucket
holds several of them; gradient accumulation and clipping are on (grad_clip 0.05 is below the
model's gradient norm, so the global norm across DP, TP and PP decides every update).
"""

from __future__ import annotations

from trainer.config.options import TrainConfig, make_config

WORKER = "tests.support.zero_workers.worker:run"
STEPS = 3
RESUME_STEPS = 4
_GPT = {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 32}
_TRAIN = {"model": "tiny", "steps": STEPS, "global_batch": 8, "lr": 3e-3, "warmup_steps": 1,
          "seed": 11, "data_cap_mb": 0.25, "bucket_size": 700, "microbatches": 2,
          "grad_clip": 0.05, "eval_every": 0, "log_every": 100}

#: (name, dp, tp, pp, overrides) per world size; every case also runs with zero 0.
CASES: dict[int, list[tuple[str, int, int, int, dict]]] = {
    2: [("dp2", 2, 1, 1, {}),
        ("dp2-untied-no-overlap", 2, 1, 1, {"overlap": False, "tied": False, "bias": True})],
    4: [("dp4", 4, 1, 1, {}),
        ("dp2-tp2", 2, 2, 1, {}),
        ("dp2-pp2", 2, 1, 2, {"schedule": "1f1b", "microbatches": 2})],
}
_GPT_KEYS = {"tied", "bias", "norm", "n_layer"}


def config(dp: int, tp: int, pp: int, over: dict, **train: object) -> TrainConfig:
    gpt = {**_GPT, **{k: v for k, v in over.items() if k in _GPT_KEYS}}
    mine = {k: v for k, v in over.items() if k not in _GPT_KEYS}
    return make_config({**_TRAIN, "dp": dp, "tp": tp, "pp": pp, **mine, **train}, gpt)


def case_config(world: int, name: str, **train: object) -> TrainConfig:
    _, dp, tp, pp, over = next(c for c in CASES[world] if c[0] == name)
    return config(dp, tp, pp, over, **train)
