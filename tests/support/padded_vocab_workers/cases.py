"""The padded-vocabulary cases, shared by the MPI worker and the single-process reference.

Every case trains the same model from the same seed with a vocabulary of 1003 (an imported
tokenizer's size, no multiple of anything) padded with ``--vocab-multiple 8``, which the trainer
turns into a multiple of 8 x tp: 1008 rows at tp 1 and 2, 1024 at tp 4. The layouts cover tp 2
and 4, dp, pp with 1F1B and interleaved stages, tp x pp, and the Llama family (untied, grouped
keys and values); all of them have 4 ranks, so one ``mpiexec`` run trains them all. The global
batch is 4 sequences in 2 microbatches everywhere, so one single-process run per family is the
reference of all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from tests.support.serial_reference import train_serially
from trainer.config.options import TrainConfig, make_config

WORKER = "tests.support.padded_vocab_workers.worker:run"
WORLD = 4
STEPS = 5
VOCAB, MULTIPLE = 1003, 8
GLOBAL_BATCH, MICROBATCHES = 4, 2
_TRAIN = {"model": "tiny", "steps": STEPS, "lr": 3e-3, "warmup_steps": 1, "seed": 11,
          "data_cap_mb": 0.25, "grad_clip": 0.5, "bucket_size": 4000,
          "global_batch": GLOBAL_BATCH, "microbatches": MICROBATCHES}
FAMILIES = {
    "gpt": {"n_layer": 4, "n_head": 4, "d_model": 32, "seq_len": 16},
    "llama": {"arch": "llama", "norm": "rmsnorm", "tied": False, "n_layer": 4, "n_head": 4,
              "n_kv_head": 2, "multiple_of": 16, "d_model": 32, "seq_len": 16},
}


@dataclass(frozen=True)
class Case:
    name: str
    dp: int
    tp: int
    pp: int
    family: str = "gpt"
    train: dict = field(default_factory=dict)

    def config(self, **train: object) -> TrainConfig:
        return config(self.family, dp=self.dp, tp=self.tp, pp=self.pp, **self.train, **train)


def config(family: str, *, multiple: int = MULTIPLE, **train: object) -> TrainConfig:
    """The run of ``family`` with the vocabulary padded to ``multiple`` (x tp)."""
    return make_config({**_TRAIN, **train}, {**FAMILIES[family], "vocab_size": VOCAB,
                                             "vocab_multiple": multiple})


CASES = [
    Case("dp2-tp2", 2, 2, 1),
    Case("tp4", 1, 4, 1),
    Case("dp2-pp2-1f1b", 2, 1, 2, train={"schedule": "1f1b"}),
    Case("tp2-pp2-interleaved", 1, 2, 2, train={"schedule": "interleaved",
                                                "virtual_stages": 2}),
    Case("llama-tp2-pp2-1f1b", 1, 2, 2, "llama", train={"schedule": "1f1b"}),
]


@functools.cache
def serial_reference(family: str, multiple: int) -> dict:
    """One process, the plain model (padded to ``multiple``; 1: not padded), the global batch
    in the same microbatches: losses, gradient norms, final parameters (fp64)."""
    return train_serially(config(family, multiple=multiple), STEPS)
