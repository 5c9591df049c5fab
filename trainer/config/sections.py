"""The sections of a GPT training run (``python -m trainer.train``): model, parallelism,
optimizer, data and checkpoints; each option declared with its help and bounds
(`trainer.schema`), each section checking its own options. Checks that relate two sections
(the model against the parallel layout) are `trainer.config.options.TrainConfig`'s.

In a TOML file each section is a table (``[parallel] tp = 2``); the model's shape goes in
``[model]`` and its experts in ``[moe]``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from trainer.activations.options import RECOMPUTE_MODES
from trainer.comm.topology import MeshShape
from trainer.config.common import CheckpointSection, LoggingSection
from trainer.data.corpus import DEFAULT_VAL_FRACTION
from trainer.errors import ConfigError
from trainer.model.config import PRESETS, GPTConfig
from trainer.parallel.pipeline.actions import ScheduleError
from trainer.parallel.pipeline.partition import parse_counts, stage_counts
from trainer.parallel.pipeline.schedule import check_interleaving, chunks_of
from trainer.schema import Section, option, section

SCHEDULES = ("gpipe", "1f1b", "interleaved")
PRECISIONS = ("auto", "fp32", "bf16")
@dataclass(frozen=True, kw_only=True)
class ModelSection(Section):
    """Which model: a preset of a family's sizes, and single fields changed from it."""

    preset: str = option("small", "model size preset: " + ", ".join(PRESETS), flag="model")
    gpt: GPTConfig = section(lambda: PRESETS["small"], "the preset's shape, then these fields",
                             merge=True)

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> ModelSection:
        """The preset named in ``values`` with the given model fields changed. ``--arch
        llama`` on a GPT preset keeps its sizes and takes Llama's other defaults (RMSNorm,
        untied head, no biases) unless they are given too."""
        preset = values.get("preset", "small")
        if preset not in PRESETS:
            raise ConfigError("unknown model preset", f"--model {preset}",
                              f"choose one of {', '.join(PRESETS)}",
                              "Pick a preset and override single fields (e.g. --n-layer)")
        fields = dict(values.get("gpt", {}))
        base = PRESETS[preset]
        if fields.get("arch") == "llama" and base.arch != "llama":
            fields = {"norm": "rmsnorm", "tied": False, "bias": False, **fields}
        moe = replace(base.moe, **fields.pop("moe", {}))
        llama = replace(base.llama, **fields.pop("llama", {}))
        return cls(preset=preset, gpt=replace(base, **fields, moe=moe, llama=llama))


@dataclass(frozen=True, kw_only=True)
class ParallelSection(Section):
    """How the ranks split the work: the mesh's degrees, the pipeline and its schedule, the
    activation-memory techniques and data-parallel gradient reduction."""

    dp: int = option(0, "data-parallel size (0 = world size / (tp*pp))", at_least=0)
    tp: int = option(1, "tensor-parallel size: heads, MLP width and vocabulary split over tp "
                     "adjacent ranks", at_least=1)
    pp: int = option(1, "pipeline-parallel size: the layers split into pp stages on pp ranks",
                     at_least=1)
    ep: int = option(1, "expert-parallel size: the experts of each MoE layer split over ep DP "
                     "ranks (trainer.parallel.expert); must divide dp and --moe-experts",
                     at_least=1)
    cp: int = option(1, "context-parallel size: every sequence split over cp adjacent ranks "
                     "(2 x cp chunks, zig-zag), attention by K/V exchange "
                     "(trainer.parallel.context); seq_len must divide by 2 x cp", at_least=1)
    cp_comm: str = option("allgather", "how context-parallel attention gets the other ranks' "
                          "K/V: allgather (all at once per layer, as Llama 3; fewer bytes in "
                          "backward, as fast on bench.context) or ring (one hop per block, "
                          "overlapped; holds two ranks' K/V at a time)",
                          choices=("ring", "allgather"))
    microbatches: int = option(1, "microbatches per step on each DP rank (gradient "
                               "accumulation; with --pp the microbatches the pipeline schedule "
                               "runs)", at_least=1)
    schedule: str = option("1f1b", "pipeline schedule: gpipe, 1f1b or interleaved (with "
                           "--virtual-stages)", choices=SCHEDULES)
    virtual_stages: int = option(1, "model chunks per pipeline rank (interleaved schedule only)",
                                 at_least=1)
    pp_layers: str = option("", "layers per pipeline stage, e.g. 3,2,2,1 (default: balanced by "
                            "layer count)")
    sequence_parallel: bool = option(False, "split the activations between tensor-parallel "
                                     "layers (norms, dropout, residuals) along the sequence "
                                     "over the tp ranks (needs tp > 1)")
    recompute: str = option("none", "activation recomputation in backward: none, selective (the "
                            "attention core) or full (every transformer block)",
                            choices=RECOMPUTE_MODES)
    zero_shard_size: int = option(0, "with --zero 1, 2 or 3, hybrid sharding: shard what the "
                                  "stage shards inside groups of this many adjacent data-"
                                  "parallel ranks (one host, say) and replicate it across the "
                                  "groups; gradients reduce-scattered inside a group, then "
                                  "all-reduced across groups (0 = shard over all of dp)",
                                  at_least=0)
    bucket_size: int = option(1_000_000, "DP gradient bucket size in elements", at_least=1)
    overlap: bool | None = option(None, "overlap the DP gradient reductions with backward "
                                  "(default: on, but on MPI without a core to spare beyond "
                                  "one per rank, where reducing after backward costs less "
                                  "CPU)")
    grad_reduce_dtype: str = option("fp32", "dtype of the DP gradient all-reduce: fp32 (the main "
                                    "gradients as they are) or bf16 (half the bytes; each "
                                    "bucket rounded first)", choices=("fp32", "bf16"))

    def check(self) -> None:
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ConfigError("virtual stages need the interleaved schedule",
                              f"--virtual-stages {self.virtual_stages}",
                              f"the {self.schedule} schedule runs one chunk per rank",
                              "Add --schedule interleaved, or use --virtual-stages 1")
        if self.schedule == "interleaved" and self.pp > 1:
            try:
                check_interleaving(self.pp, self.microbatches, self.virtual_stages)
            except ScheduleError as exc:
                raise ConfigError(exc.what, f"--pp {self.pp} --microbatches {self.microbatches} "
                                  f"--virtual-stages {self.virtual_stages}", exc.why,
                                  exc.fix.replace("microbatches", "microbatches (--microbatches)",
                                                  1)) from None
        parse_counts(self.pp_layers)
        if self.sequence_parallel and self.tp < 2:
            raise ConfigError("sequence parallelism needs tensor parallelism",
                              f"--sequence-parallel --tp {self.tp}",
                              "it splits the activations between the tensor-parallel layers "
                              "over the tp ranks, and with tp 1 there is nothing to split over",
                              "Add --tp 2 (or more), or drop --sequence-parallel")
        if self.dp and self.dp % self.ep:
            raise ConfigError("expert parallelism does not fit the data-parallel ranks",
                              f"--ep {self.ep}, dp = {self.dp}",
                              f"the EP groups are carved from the {self.dp} DP rank(s), and ep "
                              f"= {self.ep} does not divide them",
                              f"Start a multiple of {self.ep} DP ranks, or choose an ep that "
                              f"divides {self.dp}")
        if self.zero_shard_size and self.dp and self.dp % self.zero_shard_size:
            raise ConfigError("the ZeRO shard size does not divide the data-parallel ranks",
                              f"--zero-shard-size {self.zero_shard_size}, dp = {self.dp}",
                              f"the shard groups are carved from the {self.dp} DP ranks",
                              f"Choose a shard size that divides {self.dp}, or start a "
                              f"multiple of {self.zero_shard_size} DP ranks")

    def mesh(self) -> MeshShape:
        """The mesh of these degrees (dp resolved first: `trainer.config.options.resolve_dp`)."""
        return MeshShape(dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep,
                         shard=self.zero_shard_size, cp=self.cp)

    def describe(self, sep: str = ", ") -> str:
        """``dp 2 x tp 2 x pp 1`` (with ``sep`` " x "), or ``dp=2, tp=2, pp=1``; the expert-
        parallel sub-axis follows dp when it splits it: ``dp=4 (ep=2)``; cp is named when it
        is above 1."""
        eq = " " if sep == " x " else "="
        dp = f"dp{eq}{self.dp}" + (f" (ep{eq}{self.ep})" if self.ep > 1 else "")
        cp = (f"cp{eq}{self.cp}",) if self.cp > 1 else ()
        return sep.join((dp, f"tp{eq}{self.tp}", f"pp{eq}{self.pp}", *cp))

    @property
    def zero_over(self) -> int:
        """The ranks ZeRO shards a dense parameter's state over: the parameter's copies, dp x cp
        (cp ranks hold the same weights), or under hybrid sharding the shard group."""
        return self.zero_shard_size or self.dp * self.cp

    @property
    def expert_zero_over(self) -> int:
        """The ranks ZeRO shards an expert's state over: its copies, the expert-data-parallel
        group (dp / ep) x cp (`trainer.parallel.zero.split`; MoE has no hybrid sharding)."""
        return self.dp // self.ep * self.cp

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank (v): the virtual stages of the interleaved schedule."""
        return chunks_of(self.schedule, self.virtual_stages)

    def stage_layers(self, n_layer: int) -> tuple[int, ...]:
        """Layers of every pipeline stage (pp * v of them)."""
        return stage_counts(n_layer, self.pp, self.chunks, parse_counts(self.pp_layers))


@dataclass(frozen=True, kw_only=True)
class OptimizerSection(Section):
    """AdamW, its learning-rate schedule and clipping, and how the main weights are held."""

    lr: float = option(1e-3, "peak learning rate", at_least=0)
    min_lr: float = option(1e-4, "learning rate at the end of the cosine decay", at_least=0)
    warmup_steps: int = option(20, "linear warmup steps", at_least=0)
    decay_steps: int = option(0, "step at which the cosine decay reaches min_lr (0 = --steps)",
                              at_least=0)
    weight_decay: float = option(0.1, "AdamW weight decay of matrices", at_least=0)
    grad_clip: float = option(1.0, "clip the global gradient norm to this value (0 = off)",
                              at_least=0)
    precision: str = option("auto", "auto (bf16 on CUDA, fp32 on CPU), fp32, or bf16: bf16 "
                            "weights and activations with fp32 main weights, gradients and "
                            "optimizer (trainer.optim.mixed_precision)", choices=PRECISIONS)
    zero: int = option(0, "ZeRO stage: 0 (every DP rank keeps the whole optimizer state), 1 "
                       "(optimizer state and fp32 main weights sharded over DP, gradients "
                       "reduce-scattered, parameters all-gathered after the step) or 2 (the "
                       "gradients sharded too: each bucket reduce-scattered into the rank's "
                       "shard during backward, every microbatch) or 3 (the parameters sharded "
                       "too, each block gathered only while used; trainer.parallel.zero)",
                       choices=(0, 1, 2, 3))
    zero_prefetch: int = option(1, "with --zero 3: blocks gathered ahead of the one computing, "
                                "the same on every rank (each costs one block of memory)",
                                at_least=0)
    memory_budget: float = option(0.0, "GiB a rank may hold for its parameters, gradients and "
                                  "optimizer state (and, during a step, ZeRO-2/3's gathered "
                                  "units and staged gradients; activations not included): a "
                                  "layout over it is refused before the model is built, and a "
                                  "step measured over it stops the run (0 = no cap; "
                                  "trainer.plan.budget)", at_least=0)


@dataclass(frozen=True, kw_only=True)
class DataSection(Section):
    """What the run trains and evaluates on, and how much of it per step."""

    path: str | None = option(None, "what to train on: a text file or folder (byte-level; "
                              "default: the Python stdlib sources), a tokenized dataset folder "
                              "(python -m trainer.data.prepare), or a blend of them, "
                              "a:0.7,b:0.3", flag="data")
    data_cap_mb: float = option(8.0, "read at most this many MiB of training text (the "
                                "validation split is read after it)", above=0, at_most=2**43)
    val_fraction: float = option(DEFAULT_VAL_FRACTION, "hold out this last fraction of the data "
                                 "for validation (never trained on)", at_least=0, below=1)
    global_batch: int = option(32, "sequences per optimizer step, summed over data-parallel "
                               "ranks", at_least=1)
    eval_batches: int = option(4, "validation batches (of --global-batch sequences) per "
                               "evaluation", at_least=1)
    document_mask: bool = option(False, "attend within documents only: a token sees the "
                                 "earlier tokens of its own document, never those of the "
                                 "documents packed before it in the window (tokenized data, "
                                 "whose EOS id ends each document; positions stay global; "
                                 "trainer.model.documents)")


@dataclass(frozen=True, kw_only=True)
class TrainCheckpointSection(CheckpointSection):
    """`CheckpointSection`, how a save is written, and what a resume does with a damaged
    checkpoint."""

    async_save: bool = option(True, "write each checkpoint in a background thread while "
                              "training goes on (trainer.checkpoint.writer): the step's state "
                              "is copied to host memory first, at most one save is in flight, "
                              "and the end of training, SIGTERM and errors wait for it; "
                              "--no-async-save blocks every rank until the save is committed")

    init_from_hf: str = option("", "start from the weights of a Hugging Face Llama folder "
                               "(config.json + safetensors); the model's shape is the folder's, "
                               "--seq-len, --dropout and --vocab-multiple stay options; each rank "
                               "reads only its slices")
    resume_fallback: bool = option(False, "with --resume, skip damaged checkpoints (each "
                                   "reported and renamed to step-N.damaged-*) and resume from "
                                   "the newest that verifies")

    def check(self) -> None:
        super().check()
        if self.resume_fallback and not self.resume:
            raise ConfigError("--resume-fallback without --resume", "--resume-fallback",
                              "it only changes which checkpoint --resume loads", "Add --resume")


@dataclass(frozen=True, kw_only=True)
class TrainLoggingSection(LoggingSection):
    """`LoggingSection`, and the dashboards the run's metrics also go to (rank 0 writes them,
    `trainer.dashboards`)."""

    tensorboard: bool = option(False, "also write the metrics as TensorBoard event files in "
                               "<run-dir>/tensorboard")
    wandb: str = option("", "also log the metrics to Weights & Biases: offline (written under "
                        "<run-dir>/wandb for `wandb sync`) or online; needs the wandb package",
                        choices=("", "offline", "online"))
    plan_routing: bool = option(False, "plan a mixture of experts by routing the run's own "
                                "first step through its whole model (rank 0's plan line at "
                                "start-up, python -m trainer.plan): its all-to-all bytes and "
                                "experts' activations as the data routes them, at the cost of "
                                "building the model once more; off, the balanced routing's "
                                "share (trainer.plan.routing)")

    def check(self) -> None:
        super().check()
        if self.wandb and importlib.util.find_spec("wandb") is None:
            raise ConfigError("--wandb needs the wandb package", f"--wandb {self.wandb}",
                              "it is not installed in this environment",
                              "pip install 'dtrain[wandb]', or drop --wandb")
