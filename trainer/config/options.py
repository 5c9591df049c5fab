"""Typed, frozen training configuration from command-line flags and/or a TOML file.

Precedence: built-in defaults < ``--config FILE`` (TOML) < flags. Every option has one name:
``--global-batch`` on the command line is ``global_batch`` in the file. Model fields
(``n_layer``, ``seq_len``, ...) override the ``--model`` preset; in the file they go in a
``[gpt]`` table. Unknown keys and wrongly typed values are refused with the key and the file
named, so a typo never becomes a silently ignored setting.

    python -m trainer.train --model tiny --steps 50 --global-batch 16 --run-dir runs/t
    python -m trainer.train --config run.toml --steps 10      # the flag wins over the file
"""

from __future__ import annotations

import argparse
import math
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from trainer.activations.options import check_activation_options
from trainer.comm.bootstrap import BACKENDS
from trainer.config.help import HELP
from trainer.config.toml_file import load_toml
from trainer.data.corpus import DEFAULT_VAL_FRACTION
from trainer.errors import ConfigError, TrainerError
from trainer.gpu.vocab import multiple_for_tp
from trainer.model.config import PRESETS, GPTConfig
from trainer.moe.checks import check_combinations, check_layout
from trainer.pipeline.partition import parse_counts, stage_counts
from trainer.pipeline.schedule import ScheduleError, check_interleaving
from trainer.tensor_parallel.parallelize import check_divisible

SCHEDULES = ("gpipe", "1f1b", "interleaved")
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run. ``gpt`` is the resolved model (preset plus overrides)."""

    model: str = "small"
    gpt: GPTConfig = field(default_factory=lambda: PRESETS["small"])
    steps: int = 200
    stop_at: int = 0
    time_limit: float = 0.0
    global_batch: int = 32
    microbatches: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 20
    decay_steps: int = 0
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1234
    dp: int = 0
    tp: int = 1
    ep: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    pp_layers: str = ""
    sequence_parallel: bool = False
    recompute: str = "none"
    backend: str = "auto"
    bucket_size: int = 1_000_000
    overlap: bool = True
    precision: str = "auto"
    grad_reduce_dtype: str = "fp32"
    compile: bool = False
    zero: int = 0
    peak_tflops: float = 0.0
    run_dir: str = "runs/default"
    save_every: int = 0
    keep: int = 2
    resume: bool = False
    resume_fallback: bool = False
    overwrite: bool = False
    skip_nonfinite: int = 0
    data: str | None = None
    data_cap_mb: float = 8.0
    val_fraction: float = DEFAULT_VAL_FRACTION
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10

    def __post_init__(self) -> None:
        for name, value in vars(self).items():  # before the comparisons: nan fails them all
            if isinstance(value, float):
                _require(math.isfinite(value), name, value, "must be a finite number")
        for name in ("steps", "global_batch", "microbatches", "bucket_size", "log_every", "tp",
                     "eval_batches"):
            _require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        for name in ("stop_at", "warmup_steps", "decay_steps", "dp", "save_every", "keep", "seed",
                     "skip_nonfinite", "eval_every"):
            _require(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip", "peak_tflops", "time_limit"):
            _require(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        _require(self.seed < 2**64, "seed", self.seed, "must be below 2**64 (a 64-bit seed)")
        _require(0 < self.data_cap_mb <= 2**43, "data_cap_mb", self.data_cap_mb,
                 "must be > 0 and at most 2**43 (8 EiB)")
        _require(0 <= self.val_fraction < 1, "val_fraction", self.val_fraction,
                 "must be >= 0 and < 1")
        if self.eval_every and not self.val_fraction:
            raise ConfigError("evaluation without a validation split",
                              f"--eval-every {self.eval_every} --val-fraction 0",
                              "the validation loss needs held-out data",
                              "Pass --val-fraction above 0 (e.g. 0.05), or --eval-every 0")
        _require(self.backend in BACKENDS, "backend", self.backend,
                 f"must be one of {', '.join(BACKENDS)}")
        _require(self.precision in PRECISIONS, "precision", self.precision,
                 f"must be one of {', '.join(PRECISIONS)}")
        _require(self.grad_reduce_dtype in ("fp32", "bf16"), "grad_reduce_dtype",
                 self.grad_reduce_dtype, "must be fp32 or bf16")
        _require(self.zero in (0, 1), "zero", self.zero, "must be 0 or 1")
        if self.resume_fallback and not self.resume:
            raise ConfigError("--resume-fallback without --resume", "--resume-fallback",
                              "it only changes which checkpoint --resume loads", "Add --resume")
        if self.overwrite and self.resume:
            raise ConfigError("--overwrite with --resume", "--overwrite --resume",
                              "--resume continues the checkpoints that --overwrite sets aside",
                              "Drop one of them")
        try:  # refused when the options are read, not after the world is up
            check_divisible(self.gpt, self.tp)
        except TrainerError as exc:
            raise ConfigError(exc.what, exc.where, exc.why, exc.fix) from None
        self._check_pipeline()
        check_activation_options(sequence_parallel=self.sequence_parallel,
                                 recompute=self.recompute, tp=self.tp, seq_len=self.gpt.seq_len)
        check_layout(experts=self.gpt.moe_experts, ep=self.ep, dp=self.dp or None)
        check_combinations(experts=self.gpt.moe_experts, zero=self.zero,
                           sequence_parallel=self.sequence_parallel, recompute=self.recompute)

    def _check_pipeline(self) -> None:
        """Refuse a pipeline layout that cannot run, before any rank starts."""
        for name in ("pp", "virtual_stages"):
            _require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        _require(self.schedule in SCHEDULES, "schedule", self.schedule,
                 f"must be one of {', '.join(SCHEDULES)}")
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
        if self.pp > 1 or self.pp_layers:
            _ = self.stage_layers  # raises when the layers do not split

    @property
    def stage_layers(self) -> tuple[int, ...]:
        """Layers of every pipeline stage (pp * v of them; v is 1 unless interleaved)."""
        v = self.virtual_stages if self.schedule == "interleaved" else 1
        return stage_counts(self.gpt.n_layer, self.pp, v, parse_counts(self.pp_layers))

    @property
    def schedule_end(self) -> int:
        return self.decay_steps or self.steps

    @property
    def last_step(self) -> int:
        """The step this invocation stops after."""
        return min(self.steps, self.stop_at) if self.stop_at else self.steps

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "gpt"}
        out["gpt"] = self.gpt.to_dict()
        return out


def _require(ok: bool, name: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError("invalid option", f"--{_flag(name)} {value}", why,
                          f"Pass a value that {why.replace('must be', 'is')}")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _field_types(cls: type) -> dict[str, type]:
    """Scalar type of each field: ``int | None`` -> int; nested dataclasses are left out."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        if isinstance(hint, types.UnionType):
            hint = next(a for a in hint.__args__ if a is not type(None))
        if hint in (int, float, str, bool):
            out[name] = hint
    return out


TRAIN_TYPES = _field_types(TrainConfig)
GPT_TYPES = _field_types(GPTConfig)


class _Parser(argparse.ArgumentParser):
    """An argparse parser that can stay silent (and still exits with argparse's codes)."""

    def __init__(self, *args: Any, quiet: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.quiet = quiet

    def _print_message(self, message: str, file: Any = None) -> None:
        if not self.quiet:
            super()._print_message(message, file)


def build_parser(*, quiet: bool = False) -> argparse.ArgumentParser:
    """Flags for every TrainConfig and GPTConfig field; unset flags are absent from the result."""
    parser = _Parser(prog="python -m trainer.train", quiet=quiet,
                     description="Train a byte-level GPT (data, tensor and pipeline parallel).",
                     argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", metavar="FILE", help="TOML file with options ([gpt] table for "
                        "model fields); flags override it")
    for name, kind in TRAIN_TYPES.items():
        _add_flag(parser, name, kind, HELP.get(name, ""))
    group = parser.add_argument_group("model overrides (default: the --model preset)")
    for name, kind in GPT_TYPES.items():
        _add_flag(group, name, kind, f"GPTConfig.{name}")
    return parser


def _add_flag(parser: Any, name: str, kind: type, help_text: str) -> None:
    if kind is bool:
        parser.add_argument(f"--{_flag(name)}", dest=name, action=argparse.BooleanOptionalAction,
                            help=help_text)
    else:
        parser.add_argument(f"--{_flag(name)}", dest=name, type=kind, metavar=kind.__name__.upper(),
                            help=help_text)


def parse_args(argv: Sequence[str] | None = None, *, quiet: bool = False) -> TrainConfig:
    """TrainConfig from flags (and the file named by ``--config``). ``quiet`` parses without
    printing usage, errors or help (the ranks of a job but one; the exit code stays)."""
    given = vars(build_parser(quiet=quiet).parse_args(argv))
    path = given.pop("config", None)
    train, gpt = load_toml(path, TRAIN_TYPES, GPT_TYPES) if path else ({}, {})
    train.update({k: v for k, v in given.items() if k in TRAIN_TYPES})
    gpt.update({k: v for k, v in given.items() if k in GPT_TYPES})
    return make_config(train, gpt, source=path or "command line")


def make_config(train: dict[str, Any], gpt: dict[str, Any], *, source: str = "") -> TrainConfig:
    """Resolve the preset, apply model overrides and validate everything."""
    preset = train.get("model", TrainConfig.model)
    if preset not in PRESETS:
        raise ConfigError("unknown model preset", f"--model {preset}",
                          f"choose one of {', '.join(PRESETS)}",
                          "Pick a preset and override single fields (e.g. --n-layer)")
    try:
        model = replace(PRESETS[preset], **gpt)
        model = replace(model, vocab_multiple=multiple_for_tp(model.vocab_multiple,
                                                              train.get("tp", TrainConfig.tp)))
    except ValueError as exc:
        raise ConfigError("invalid model configuration", source, str(exc),
                          "Change the model fields named above") from None
    return TrainConfig(**train, gpt=model)


def resolve_dp(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """Fill in dp from the world size and check dp*tp*pp == world size."""
    model = cfg.tp * cfg.pp
    if not cfg.dp and world_size % model:
        few = world_size < model
        raise ConfigError("parallel layout does not fit the world",
                          f"tp={cfg.tp} pp={cfg.pp}, {world_size} rank(s)",
                          f"one model copy takes tp*pp = {model} ranks, "
                          + (f"more than the {world_size} started" if few else
                             f"which does not divide the {world_size} started"),
                          f"Start a multiple of {model} ranks (e.g. --nproc-per-node {model}), "
                          f"or choose --tp and --pp whose product divides {world_size}")
    dp = cfg.dp or world_size // model
    if dp * model != world_size:
        raise ConfigError("parallel layout does not fit the world",
                          f"--dp {dp} --tp {cfg.tp} --pp {cfg.pp}",
                          f"dp*tp*pp = {dp * model} but {world_size} ranks were started",
                          f"Start {dp * model} ranks, or leave --dp out to derive it from the "
                          "number of ranks")
    if cfg.global_batch % (dp * cfg.microbatches):
        raise ConfigError("global batch does not split evenly",
                          f"--global-batch {cfg.global_batch}",
                          f"it must be divisible by dp*microbatches = {dp}*{cfg.microbatches}",
                          f"Use a multiple of {dp * cfg.microbatches}")
    return replace(cfg, dp=dp)
