"""The DP equivalence cases, shared by the MPI worker and the single-process reference.

Each case is a tiny model and a global batch that divides by dp * microbatches for dp in
{1, 2, 4}; the cases differ in what the gradient sync has to get right.
"""

from __future__ import annotations

from trainer.config.options import TrainConfig, make_config

STEPS = 3
_TINY = {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 32}
_COMMON = {"model": "tiny", "steps": STEPS, "global_batch": 8, "lr": 3e-3, "warmup_steps": 1,
           "seed": 7, "data_cap_mb": 0.25}

CASES: dict[str, tuple[dict, dict]] = {
    # one bucket holding every gradient
    "one_bucket": ({"bucket_size": 10**9}, {}),
    # gradient accumulation: reduce only on the last of 2 microbatches
    "accumulation": ({"microbatches": 2, "bucket_size": 5000}, {}),
    # many small buckets in flight at once; clipping active; untied head, RMSNorm, biases
    "small_buckets": ({"bucket_size": 600, "grad_clip": 0.05},
                      {"tied": False, "norm": "rmsnorm", "bias": True}),
    # overlap off: every bucket reduced synchronously after backward
    "no_overlap": ({"microbatches": 2, "bucket_size": 2000, "overlap": False}, {}),
}


def case_config(name: str) -> TrainConfig:
    train, gpt = CASES[name]
    return make_config({**_COMMON, **train}, {**_TINY, **gpt})
