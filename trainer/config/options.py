"""Typed, frozen training configuration in sections, from command-line flags and/or a TOML file.

Precedence: built-in defaults < ``--config FILE`` (TOML) < flags. Every option has one name:
``--global-batch`` on the command line is ``global_batch`` in the file's ``[data]`` table. The
sections (`trainer.config.sections`, `trainer.config.common`, the model's and its experts' in
`trainer.model.config`) declare each option with its help and bounds and check themselves;
`TrainConfig` adds the checks that relate two sections (the model against the layout). Model
fields override the ``--model`` preset. Unknown keys and wrongly typed values are refused with
the key and the file named, so a typo never becomes a silently ignored setting.

    python -m trainer.train --model tiny --steps 50 --global-batch 16 --run-dir runs/t
    python -m trainer.train --config run.toml --steps 10      # the flag wins over the file
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainer.activations.options import check_sequence_split
from trainer.comm.bootstrap import BACKENDS
from trainer.config.flags import option_table, parse
from trainer.config.sections import (
    DataSection,
    ModelSection,
    OptimizerSection,
    ParallelSection,
    TrainCheckpointSection,
    TrainLoggingSection,
)
from trainer.errors import ConfigError, TrainerError
from trainer.gpu.vocab import multiple_for_tp
from trainer.model.config import GPTConfig
from trainer.parallel.context.checks import check_context
from trainer.parallel.expert.checks import check_moe
from trainer.parallel.tensor.parallelize import check_divisible
from trainer.parallel.zero.checks import check_zero
from trainer.schema import (
    Section,
    build,
    build_fields,
    flatten,
    nest,
    option,
    replaced,
    section,
)


@dataclass(frozen=True, kw_only=True)
class TrainConfig(Section):
    """One training run: how long, on which devices, and its sections."""

    steps: int = option(200, "optimizer steps to train in total (a resumed run stops at the "
                        "same step)", at_least=1)
    stop_at: int = option(0, "stop after this step with a checkpoint, to split a run into jobs "
                          "(0 = --steps); the learning-rate schedule still spans --steps",
                          at_least=0)
    time_limit: float = option(0.0, "stop after this many seconds of training with a "
                               "checkpoint, every rank after the same step (checked every "
                               "--log-every steps; 0 = no limit)", at_least=0)
    seed: int = option(1234, "seed of initialisation, data order and dropout", at_least=0,
                       below=2**64)
    skip_nonfinite: int = option(0, "skip at most N steps whose loss or gradient norm is NaN or "
                                 "Inf (their update is dropped) before stopping; 0 = stop at "
                                 "the first", at_least=0)
    run_dir: str = option("runs/default", "folder for checkpoints, metrics.jsonl and loss.png")
    backend: str = option("auto", "communication backend: auto (nccl on GPU, else mpi), mpi "
                          "or nccl", choices=BACKENDS)
    compile: bool = option(False, "torch.compile every transformer block (checked at start-up; "
                           "where it cannot work, one message and eager blocks, "
                           "trainer.gpu.compile)")
    peak_tflops: float = option(0.0, "peak TFLOP/s of one device for the logged MFU (0 = bf16 "
                                "dense peak of a known GPU: H100, H200, A100; a CPU logs MFU "
                                "only when given)", at_least=0)
    model: ModelSection = section(ModelSection, "the model")
    parallel: ParallelSection = section(ParallelSection, "parallelism")
    optimizer: OptimizerSection = section(OptimizerSection, "the optimizer")
    data: DataSection = section(DataSection, "the data")
    checkpoint: TrainCheckpointSection = section(TrainCheckpointSection, "checkpoints")
    logging: TrainLoggingSection = section(TrainLoggingSection, "logging, evaluation and "
                                           "dashboards")

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> TrainConfig:
        """The config of ``values``, the model's vocabulary the data's when ``--data`` names
        tokenized datasets and ``--vocab-size`` is not given: their tokenizer's ids are the
        model's tokens (a preset's vocabulary is the tokenizer it was made for, not this
        data's). A ``--vocab-size`` given is kept, and refused at start-up if the data's ids
        do not fit it."""
        model = values.get("model", {})
        path = values.get("data", {}).get("path")
        if path and "vocab_size" not in model.get("gpt", {}):
            from trainer.data.sources import data_vocab, parse_data  # numpy: only when asked

            vocab = data_vocab(parse_data(path))
            if vocab is not None:
                values = {**values, "model": {**model, "gpt": {**model.get("gpt", {}),
                                                              "vocab_size": vocab}}}
        return build_fields(cls, values)  # type: ignore[no-any-return]

    def check(self) -> None:
        """What relates two sections: the model against the layout, evaluation and data."""
        gpt, par = self.model.gpt, self.parallel
        try:  # refused when the options are read, not after the world is up
            check_divisible(gpt, par.tp)
        except TrainerError as exc:
            raise ConfigError(exc.what, exc.where, exc.why, exc.fix) from None
        if par.pp > 1 or par.pp_layers:
            _ = self.stage_layers  # raises when the layers do not split
        check_sequence_split(sequence_parallel=par.sequence_parallel, tp=par.tp,
                             seq_len=gpt.seq_len)
        check_moe(gpt.moe, par, zero=self.optimizer.zero)
        check_zero(self.optimizer.zero, par, precision=self.optimizer.precision,
                   compiled=self.compile)
        check_context(cp=par.cp, seq_len=gpt.seq_len, tp=par.tp,
                      sequence_parallel=par.sequence_parallel, dropout=gpt.dropout,
                      compiled=self.compile, zero_shard_size=par.zero_shard_size)
        if self.logging.eval_every and not self.data.val_fraction:
            raise ConfigError("evaluation without a validation split",
                              f"--eval-every {self.logging.eval_every} --val-fraction 0",
                              "the validation loss needs held-out data",
                              "Pass --val-fraction above 0 (e.g. 0.05), or --eval-every 0")

    @property
    def gpt(self) -> GPTConfig:
        """The resolved model (the preset and its overrides)."""
        return self.model.gpt

    @property
    def stage_layers(self) -> tuple[int, ...]:
        """Layers of every pipeline stage (pp * v of them; v is 1 unless interleaved)."""
        return self.parallel.stage_layers(self.model.gpt.n_layer)

    @property
    def decay_end(self) -> int:
        """The step at which the learning rate reaches its minimum."""
        return self.optimizer.decay_steps or self.steps

    @property
    def last_step(self) -> int:
        """The step this invocation stops after."""
        return min(self.steps, self.stop_at) if self.stop_at else self.steps

    @property
    def micro_batch(self) -> int:
        """Sequences per microbatch on one DP rank (dp resolved)."""
        return self.data.global_batch // (self.parallel.dp * self.parallel.microbatches)

    def to_dict(self) -> dict[str, Any]:
        """Every option's value by flag name (what a checkpoint's meta.json records)."""
        return flatten(self, OPTIONS)

    def with_options(self, **changes: Any) -> TrainConfig:
        """This config with the options named by flag changed (checked again); the preset is
        resolved only when a config is made, so ``model`` is not one of them."""
        return replaced(self, changes, OPTIONS)


OPTIONS = option_table(TrainConfig)
"""Every option of a training run by flag name."""


def parse_args(argv: Sequence[str] | None = None, *, quiet: bool = False) -> TrainConfig:
    """TrainConfig from flags (and the file named by ``--config``). ``quiet`` parses without
    printing usage, errors or help (the ranks of a job but one; the exit code stays)."""
    return _with_tp_padding(_with_hf_model(parse(
        TrainConfig, argv, prog="python -m trainer.train", quiet=quiet,
        description="Train a GPT or Llama on one process or in parallel (the [parallel] "
                    "options).")))


def make_config(train: Mapping[str, Any] | None = None,
                gpt: Mapping[str, Any] | None = None) -> TrainConfig:
    """A checked config from options by flag name (``gpt``: model fields, for readability; the
    same names may be in ``train``), the way `parse_args` makes it."""
    values = {**(train or {}), **(gpt or {})}
    unknown = sorted(set(values) - set(OPTIONS))
    if unknown:
        raise ConfigError("unknown option", ", ".join(unknown), "not an option of the trainer",
                          "Use the names of the flags, with _ for -")
    return _with_tp_padding(_with_hf_model(build(TrainConfig, nest(values, OPTIONS))))


def _with_hf_model(cfg: TrainConfig) -> TrainConfig:
    """With ``--init-from-hf DIR``: the model is the folder's (`trainer.hf.config`), at the
    run's sequence length, dropout and vocabulary padding."""
    if not cfg.checkpoint.init_from_hf:
        return cfg
    from trainer.hf.folder import read_folder  # safetensors: only when asked for

    gpt = read_folder(Path(cfg.checkpoint.init_from_hf), seq_len=cfg.gpt.seq_len,
                      vocab_multiple=cfg.gpt.vocab_multiple).cfg
    gpt = replace(gpt, dropout=cfg.gpt.dropout, moe=cfg.gpt.moe)
    return replace(cfg, model=replace(cfg.model, gpt=gpt))


def _with_tp_padding(cfg: TrainConfig) -> TrainConfig:
    """The model's vocabulary padded to a multiple of ``vocab_multiple x tp`` rows
    (`trainer.gpu.vocab`)."""
    return cfg.with_options(vocab_multiple=multiple_for_tp(cfg.gpt.vocab_multiple,
                                                           cfg.parallel.tp))


def resolve_dp(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """Fill in dp from the world size and check dp*tp*pp*cp == world size."""
    par = cfg.parallel
    model = par.tp * par.pp * par.cp
    with_cp = par.cp > 1
    tp_pp = "tp*pp" + ("*cp" if with_cp else "")
    if not par.dp and world_size % model:
        few = world_size < model
        raise ConfigError("parallel layout does not fit the world",
                          f"tp={par.tp} pp={par.pp}" + (f" cp={par.cp}" if with_cp else "")
                          + f", {world_size} rank(s)",
                          f"one model copy takes {tp_pp} = {model} ranks, "
                          + (f"more than the {world_size} started" if few else
                             f"which does not divide the {world_size} started"),
                          f"Start a multiple of {model} ranks (e.g. --nproc-per-node {model}), "
                          f"or choose --tp and --pp{', --cp' if with_cp else ''} whose product "
                          f"divides {world_size}")
    dp = par.dp or world_size // model
    if dp * model != world_size:
        raise ConfigError("parallel layout does not fit the world",
                          f"--dp {dp} --tp {par.tp} --pp {par.pp}"
                          + (f" --cp {par.cp}" if with_cp else ""),
                          f"dp*{tp_pp} = {dp * model} but {world_size} ranks were started",
                          f"Start {dp * model} ranks, or leave --dp out to derive it from the "
                          "number of ranks")
    if cfg.data.global_batch % (dp * par.microbatches):
        raise ConfigError("global batch does not split evenly",
                          f"--global-batch {cfg.data.global_batch}",
                          f"it must be divisible by dp*microbatches = {dp}*{par.microbatches}",
                          f"Use a multiple of {dp * par.microbatches}")
    return cfg.with_options(dp=dp)
