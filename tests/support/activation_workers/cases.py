"""The runs of the sequence-parallel, recompute and construction tests, shared by the MPI
worker and the pytest process.

Every run trains the tiny GPT for `STEPS` steps in fp64 with the trainer's own ``build_run`` /
``train_step``; each run with a technique switched on names the run it must match (the same
layout without it). Four layers, so pp 2 with 2 virtual stages gets one layer per chunk; 16
bytes of context, so the sequence splits over tp 4.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.config.options import TrainConfig, make_config
from trainer.model.config import GPTConfig

#: The rank function every test of tests/trainer/test_activations.py reads (one run per world size).
WORKER = "tests.support.activation_workers.worker:run"
STEPS = 3
GLOBAL_BATCH = 4
GPT = {"n_layer": 4, "n_head": 4, "d_model": 32, "seq_len": 16}
TRAIN = {"model": "tiny", "steps": STEPS, "global_batch": GLOBAL_BATCH, "microbatches": 2,
         "lr": 3e-3, "warmup_steps": 1, "seed": 7, "data_cap_mb": 0.25, "grad_clip": 0.5,
         "eval_every": 0}
UNTIED = {"tied": False, "norm": "rmsnorm", "bias": True}
DROPOUT = {"dropout": 0.2}


@dataclass(frozen=True)
class Run:
    name: str
    tp: int = 1
    pp: int = 1
    base: str = ""
    """The run this one must match ("": a baseline)."""
    train: dict = field(default_factory=dict)
    gpt: dict = field(default_factory=dict)

    def config(self, run_dir: str) -> TrainConfig:
        over = {"tp": self.tp, "pp": self.pp, "dp": 1, "run_dir": run_dir, **self.train}
        return make_config({**TRAIN, **over}, {**GPT, **self.gpt})


def _family(prefix: str, tp: int, pp: int, variants: dict[str, dict], *,
            gpt: dict | None = None, train: dict | None = None) -> list[Run]:
    """A baseline ``prefix`` and one run per variant (suffix -> extra train options)."""
    gpt, train = gpt or {}, train or {}
    return [Run(prefix, tp, pp, train=train, gpt=gpt),
            *(Run(f"{prefix}-{suffix}", tp, pp, prefix, {**train, **extra}, gpt)
              for suffix, extra in variants.items())]


SP = {"sequence_parallel": True}
SELECTIVE, FULL = {"recompute": "selective"}, {"recompute": "full"}
PIPE = {schedule: {"schedule": schedule} for schedule in ("gpipe", "1f1b")}
PIPE["interleaved"] = {"schedule": "interleaved", "virtual_stages": 2}

#: Runs by world size (dp 1 everywhere: DP is not what these techniques change).
RUNS: dict[int, list[Run]] = {
    2: [*_family("tp2", 2, 1, {"sp": SP, "selective": SELECTIVE, "full": FULL}),
        *_family("tp2-untied", 2, 1, {"sp": SP, "sp-selective": {**SP, **SELECTIVE}},
                 gpt=UNTIED),
        # full recompute in every schedule, selective in 1F1B
        *(run for schedule, opts in PIPE.items()
          for run in _family(f"pp2-{schedule}", 1, 2,
                             {"full": FULL, **({"selective": SELECTIVE}
                                               if schedule == "1f1b" else {})}, train=opts)),
        # dropout on: recompute must redraw the very same masks (default and TP streams)
        *_family("tp2-drop", 2, 1, {"selective": SELECTIVE, "full": FULL}, gpt=DROPOUT),
        *_family("tp2-drop-sp", 2, 1, {"full": FULL}, gpt=DROPOUT, train=SP),
        *_family("pp2-drop", 1, 2, {"full": FULL}, gpt=DROPOUT, train=PIPE["1f1b"])],
    4: [*_family("tp4", 4, 1, {"sp": SP, "sp-full": {**SP, **FULL}}),
        *_family("tp4-untied", 4, 1, {"sp": SP}, gpt=UNTIED),
        *_family("tp2-pp2", 2, 2, {"sp-full": {**SP, **FULL}, "sp-selective": {**SP, **SELECTIVE}},
                 train=PIPE["interleaved"])],
}

#: Per-rank construction: big enough that its weights exceed `init_stream.PIECE` elements.
BIG = GPTConfig(n_layer=2, n_head=4, d_model=256, seq_len=16)
BIG_SEED = 3
#: (tp, pp) layouts built per world size.
CONSTRUCTION: dict[int, list[tuple[int, int]]] = {2: [(2, 1), (1, 2)], 4: [(4, 1), (2, 2)]}
