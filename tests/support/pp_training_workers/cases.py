"""The PP training cases, shared by the MPI worker and the single-process reference.

A case is a parallel layout (dp, tp, pp), a schedule with its microbatches and virtual stages,
and model/training overrides. The model has 8 layers so that pp 4 x v 2 gets one layer per
stage; it is tiny otherwise (d_model 32, 16 bytes of context). Every case clips (grad_clip 0.5
is below the model's gradient norm), so the global norm across TP and PP decides each update.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from tests.support.serial_reference import train_serially
from trainer.config.options import TrainConfig, make_config

#: The rank function every PP training test reads (one run per world size:
# `tests.support.mpi_runs`).
WORKER = "tests.support.pp_training_workers.worker:run"
STEPS = 3
_GPT = {"n_layer": 8, "n_head": 2, "d_model": 32, "seq_len": 16}
_TRAIN = {"model": "tiny", "steps": STEPS, "lr": 3e-3, "warmup_steps": 1, "seed": 5,
          "data_cap_mb": 0.25, "grad_clip": 0.5, "bucket_size": 4000}
_UNTIED = {"tied": False, "norm": "rmsnorm", "bias": True}


@dataclass(frozen=True)
class Case:
    name: str
    dp: int
    tp: int
    pp: int
    schedule: str
    m: int
    v: int = 1
    gpt: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def config(self, **train: object) -> TrainConfig:
        over = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "schedule": self.schedule,
                "microbatches": self.m, "virtual_stages": self.v,
                "global_batch": self.dp * self.m, **self.train, **train}
        return make_config({**_TRAIN, **over}, {**_GPT, **self.gpt})


def _schedules(pp: int) -> list[Case]:
    return [Case(f"pp{pp}-gpipe", 1, 1, pp, "gpipe", 4),
            Case(f"pp{pp}-1f1b", 1, 1, pp, "1f1b", 4),
            Case(f"pp{pp}-interleaved", 1, 1, pp, "interleaved", 4, 2)]


#: Cases by world size: one mpiexec run per world size trains all of its cases.
CASES: dict[int, list[Case]] = {
    2: [*_schedules(2),
        # untied head, RMSNorm, biases, an uneven split given by hand, 3 microbatches
        Case("pp2-1f1b-untied-split", 1, 1, 2, "1f1b", 3, gpt=_UNTIED,
             train={"pp_layers": "5,3"})],
    4: [*_schedules(4),
        Case("dp2-pp2-1f1b", 2, 1, 2, "1f1b", 2),
        Case("tp2-pp2-interleaved", 1, 2, 2, "interleaved", 2, 2)],
    8: [Case("dp2-tp2-pp2-interleaved", 2, 2, 2, "interleaved", 4, 2),
        Case("dp2-tp2-pp2-1f1b-untied", 2, 2, 2, "1f1b", 2, gpt=_UNTIED)],
}
#: The case each world also trains through ``trainer.train.train`` with a checkpoint at step 2
#: and a resume, and whose checkpoint it then tries to resume with pp = 1.
CHECKPOINT_CASE = {2: "pp2-interleaved", 8: "dp2-tp2-pp2-interleaved"}


def case(name: str) -> Case:
    return next(c for cases in CASES.values() for c in cases if c.name == name)


def serial_key(c: Case) -> tuple:
    """What the single-device run depends on: the layout and schedule do not count."""
    return (c.dp * c.m, c.m, tuple(sorted(c.gpt.items())))


@functools.cache
def _serial(key: tuple) -> dict:
    global_batch, m, gpt = key
    cfg = make_config({**_TRAIN, "global_batch": global_batch, "microbatches": m}, {**_GPT,
                                                                                     **dict(gpt)})
    return train_serially(cfg, STEPS)


def serial_reference(c: Case) -> dict:
    """One process, the plain model, the whole global batch in the case's microbatches (as a
    single device with gradient accumulation runs it), torch's clipping: losses, gradient
    norms before clipping, final parameters."""
    return _serial(serial_key(c))
