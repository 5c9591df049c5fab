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
import difflib
import tomllib
import types
import typing
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from trainer.comm.bootstrap import BACKENDS
from trainer.errors import ConfigError
from trainer.model import PRESETS, GPTConfig
from trainer.pipeline.partition import parse_counts, stage_counts
from trainer.pipeline.schedule import ScheduleError, check_interleaving

SCHEDULES = ("gpipe", "1f1b", "interleaved")

HELP: dict[str, str] = {
    "model": "model size preset: " + ", ".join(PRESETS),
    "steps": "optimizer steps to train in total (a resumed run stops at the same step)",
    "stop_at": "stop after this step with a checkpoint, to split a run into jobs (0 = --steps);"
               " the learning-rate schedule still spans --steps",
    "global_batch": "sequences per optimizer step, summed over data-parallel ranks",
    "microbatches": "microbatches per step on each DP rank (gradient accumulation; with --pp "
                    "the microbatches the pipeline schedule runs)",
    "lr": "peak learning rate",
    "min_lr": "learning rate at the end of the cosine decay",
    "warmup_steps": "linear warmup steps",
    "decay_steps": "step at which the cosine decay reaches min_lr (0 = --steps)",
    "weight_decay": "AdamW weight decay of matrices",
    "grad_clip": "clip the global gradient norm to this value (0 = off)",
    "seed": "seed of initialisation, data order and dropout",
    "dp": "data-parallel size (0 = world size / (tp*pp))",
    "tp": "tensor-parallel size: heads, MLP width and vocabulary split over tp adjacent ranks",
    "pp": "pipeline-parallel size: the layers split into pp stages on pp ranks",
    "schedule": "pipeline schedule: gpipe, 1f1b or interleaved (with --virtual-stages)",
    "virtual_stages": "model chunks per pipeline rank (interleaved schedule only)",
    "pp_layers": "layers per pipeline stage, e.g. 3,2,2,1 (default: balanced by layer count)",
    "backend": "communication backend: auto (nccl on GPU, else mpi), mpi or nccl",
    "bucket_size": "DP gradient bucket size in elements",
    "overlap": "overlap DP gradient all-reduce with backward",
    "run_dir": "folder for checkpoints, metrics.jsonl and loss.png",
    "save_every": "save a checkpoint every N steps (0 = only at the end)",
    "keep": "number of newest checkpoints to keep (0 = all)",
    "resume": "continue from the newest committed checkpoint in --run-dir (none: start at step "
              "0); refused if its checksums do not verify",
    "resume_fallback": "with --resume, skip damaged checkpoints (each reported and renamed to "
                       "step-N.damaged-*) and resume from the newest that verifies",
    "skip_nonfinite": "skip at most N steps whose loss or gradient norm is NaN or Inf (their "
                      "update is dropped) before stopping; 0 = stop at the first",
    "data": "text file or folder to train on (default: the Python stdlib sources)",
    "data_cap_mb": "read at most this many MiB of training text",
    "log_every": "print a log line every N steps",
}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run. ``gpt`` is the resolved model (preset plus overrides)."""

    model: str = "small"
    gpt: GPTConfig = field(default_factory=lambda: PRESETS["small"])
    steps: int = 200
    stop_at: int = 0
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
    pp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    pp_layers: str = ""
    backend: str = "auto"
    bucket_size: int = 1_000_000
    overlap: bool = True
    run_dir: str = "runs/default"
    save_every: int = 0
    keep: int = 2
    resume: bool = False
    resume_fallback: bool = False
    skip_nonfinite: int = 0
    data: str | None = None
    data_cap_mb: float = 8.0
    log_every: int = 10

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "microbatches", "bucket_size", "log_every", "tp"):
            _require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        for name in ("stop_at", "warmup_steps", "decay_steps", "dp", "save_every", "keep", "seed",
                     "skip_nonfinite"):
            _require(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip", "data_cap_mb"):
            _require(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        _require(self.backend in BACKENDS, "backend", self.backend,
                 f"must be one of {', '.join(BACKENDS)}")
        if self.resume_fallback and not self.resume:
            raise ConfigError("--resume-fallback without --resume", "--resume-fallback",
                              "it only changes which checkpoint --resume loads", "Add --resume")
        self._check_pipeline()

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


def build_parser() -> argparse.ArgumentParser:
    """Flags for every TrainConfig and GPTConfig field; unset flags are absent from the result."""
    parser = argparse.ArgumentParser(prog="python -m trainer.train",
                                     description="Train a byte-level GPT (data parallel over MPI).",
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


def load_toml(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(train options, gpt overrides) from a TOML file, every key and type checked."""
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError("cannot read config file", path, exc.strerror or str(exc),
                          "Check the path given to --config") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config file is not valid TOML", path, str(exc),
                          "Fix the syntax at the position shown") from None
    gpt = doc.pop("gpt", {})
    if not isinstance(gpt, dict):
        raise ConfigError("invalid config value", f"{path}: gpt", "gpt must be a table",
                          "Write model fields under a [gpt] header")
    return _checked(doc, TRAIN_TYPES, path, ""), _checked(gpt, GPT_TYPES, path, "gpt.")


def _checked(table: dict[str, Any], schema: dict[str, type], path: str, prefix: str
             ) -> dict[str, Any]:
    for key, value in table.items():
        if key not in schema:
            close = difflib.get_close_matches(key, schema, n=1)
            hint = f"Did you mean '{prefix}{close[0]}'?" if close else \
                f"Known keys: {', '.join(prefix + k for k in schema)}"
            raise ConfigError("unknown config key", f"{path}: {prefix}{key}",
                              f"'{prefix}{key}' is not an option of the trainer", hint)
        kind = schema[key]
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConfigError("invalid config value", f"{path}: {prefix}{key} = {value!r}",
                              f"expected {kind.__name__}, got {type(value).__name__}",
                              f"Write {prefix}{key} as a TOML {kind.__name__}")
        table[key] = value
    return table


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """TrainConfig from flags (and the file named by ``--config``)."""
    given = vars(build_parser().parse_args(argv))
    path = given.pop("config", None)
    train, gpt = load_toml(path) if path else ({}, {})
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
    except ValueError as exc:
        raise ConfigError("invalid model configuration", source, str(exc),
                          "Change the model fields named above") from None
    return TrainConfig(**train, gpt=model)


def resolve_dp(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """Fill in dp from the world size and check dp*tp*pp == world size."""
    dp = cfg.dp or world_size // (cfg.tp * cfg.pp)
    if dp * cfg.tp * cfg.pp != world_size:
        raise ConfigError("parallel layout does not fit the world",
                          f"dp={dp} tp={cfg.tp} pp={cfg.pp}",
                          f"dp*tp*pp = {dp * cfg.tp * cfg.pp} but {world_size} ranks were started",
                          "Start dp*tp*pp ranks, or leave --dp out to derive it")
    if cfg.global_batch % (dp * cfg.microbatches):
        raise ConfigError("global batch does not split evenly",
                          f"--global-batch {cfg.global_batch}",
                          f"it must be divisible by dp*microbatches = {dp}*{cfg.microbatches}",
                          f"Use a multiple of {dp * cfg.microbatches}")
    return replace(cfg, dp=dp)


def defaults_of(cls: type) -> dict[str, Any]:
    """Field defaults (for docs and tests)."""
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}
