"""What the MoE workers train and the serial reference they are compared with.

Shared by the MPI worker and the pytest process. Every layout runs 4 ranks and sees the same
8 sequences per step split into 4 forward passes of 2 sequences (dp 4 x 1 microbatch, or dp 2 x
2 microbatches), so the serial reference (one process, 4 microbatches, every MoE layer computed
by the plain loop of `tests.support.moe_reference`) routes, drops and balances exactly the same
tokens.
Layer 0 is an MoE layer, layer 1 a dense one, so ep 2 x pp 2 puts the experts on the first
stage only and the auxiliary loss must reach the router through the pipeline.
"""

from __future__ import annotations

import functools

from tests.support.moe_reference import use_reference
from tests.support.serial_reference import train_serially
from trainer.config.options import TrainConfig, make_config
from trainer.model.gpt import GPT
from trainer.parallel.expert.layer import set_aux_scale

WORKER = "tests.support.moe_workers.worker:run"
WORLD = 4
STEPS = 2
FORWARDS = 4  # forward passes per step over all DP ranks
_MODEL = {"n_layer": 2, "n_head": 2, "d_model": 16, "seq_len": 16, "moe_experts": 4,
          "moe_topk": 2, "moe_every": 2, "moe_z_loss_coeff": 1e-3}
_COMMON = {"model": "tiny", "steps": STEPS, "global_batch": 8, "lr": 3e-3, "warmup_steps": 1,
           "seed": 11, "data_cap_mb": 0.25, "grad_clip": 0.5, "eval_every": 0}

CASES: dict[str, dict] = {
    "dropless": {},
    # 2 sequences x 16 tokens x top-2 over 4 experts: each keeps ceil(64 * 0.5 / 4) = 8
    "dropping": {"moe_capacity_factor": 0.5, "moe_router": "sigmoid"},
}

LAYOUTS: dict[str, dict] = {
    "ep1": {"dp": 4, "ep": 1, "microbatches": 1},
    "ep2": {"dp": 4, "ep": 2, "microbatches": 1},
    "ep4": {"dp": 4, "ep": 4, "microbatches": 1},
    "ep2tp2": {"dp": 2, "tp": 2, "ep": 2, "microbatches": 2},
    "ep2pp2": {"dp": 2, "pp": 2, "ep": 2, "microbatches": 2},
}


def case_config(case: str, layout: str | dict | None = None, *, model: dict | None = None,
                **train: object) -> TrainConfig:
    """The case at ``layout`` (a name of `LAYOUTS` or its options; None: the serial
    reference's single process), with ``model`` and ``train`` overriding the defaults."""
    where = LAYOUTS[layout] if isinstance(layout, str) else layout
    options = {**_COMMON, **(where if where else {"microbatches": FORWARDS}), **train}
    return make_config(options, {**_MODEL, **CASES[case], **(model or {})})


def plain_loop(microbatches: int):  # noqa: ANN201 - a train_serially hook
    def prepare(model: GPT) -> None:
        set_aux_scale(model, microbatches)
        use_reference(model)
    return prepare


@functools.cache
def serial_reference(case: str) -> dict:
    """Losses, gradient norms and final parameters of the plain-loop model in fp64."""
    return train_serially(case_config(case), STEPS, prepare=plain_loop(FORWARDS))
