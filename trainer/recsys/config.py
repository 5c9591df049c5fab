"""Options of ``python -m trainer.recsys``: a frozen `RecsysConfig` from command-line flags.

Checks that need no other rank (sizes, choices, the run dir: `trainer.checkpoint.run_dir`) run
here; those that need the world (the batch
divides over the ranks) in `check_world`. Every refusal names the flag and how to fix it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from trainer.checkpoint import run_dir
from trainer.comm.bootstrap import BACKENDS
from trainer.config.options import _Parser  # the GPT trainer's quiet-capable argparse
from trainer.errors import ConfigError
from trainer.recsys.data import CRITEO_SPARSE
from trainer.recsys.model import DLRMConfig
from trainer.sparse import KINDS

HELP: dict[str, str] = {
    "steps": "optimizer steps in total (a resumed run stops at the same step)",
    "global_batch": "click-log rows per step, summed over the ranks (must divide by them)",
    "optimizer": "rule for the embeddings and the MLPs: sgd, adagrad or adam (lazy per-row "
                 "Adam for the embeddings)",
    "lr": "learning rate of the MLPs",
    "embedding_lr": "learning rate of the embedding rows",
    "dim": "embedding width (and the bottom MLP's output)",
    "bottom": "hidden widths of the bottom MLP, e.g. 64,32",
    "top": "hidden widths of the top MLP",
    "data": "Criteo-format TSV file (label, 13 integers, 26 hex categoricals); default: the "
            "synthetic click log",
    "rows": "rows of the synthetic click log (or at most this many of --data; 0 = all)",
    "features": "categorical features of the synthetic log",
    "vocab": "keys per categorical feature: one number for all, or one per feature (Criteo "
             "keys are taken mod it); with --hash-capacity the keys are used as they are",
    "zipf": "power-law exponent of the synthetic keys' frequencies",
    "hash_capacity": "hash mode: rows per rank of an open-addressing table (0: identity mode, "
                     "sum(vocab) rows sharded over the ranks)",
    "val_fraction": "hold out this last fraction of the rows for validation",
    "eval_every": "validation log-loss and AUC every N steps and at the end (0 = never)",
    "seed": "seed of the synthetic log, initialisation and batch order",
    "backend": "communication backend: auto (nccl on GPU, else mpi), mpi or nccl",
    "run_dir": "folder for checkpoints, metrics.jsonl, loss.png and auc.png",
    "save_every": "save a checkpoint every N steps (0 = only at the end)",
    "keep": "number of newest checkpoints to keep (0 = all)",
    "resume": "continue from the newest committed checkpoint in --run-dir",
    "overwrite": "start a new run in a --run-dir that holds another run's checkpoints (refused "
                 "without it): they and the metrics are moved to <run-dir>/replaced-<time>/",
    "log_every": "print a log line every N steps",
}


@dataclass(frozen=True, kw_only=True)
class RecsysConfig:
    steps: int = 200
    global_batch: int = 256
    optimizer: str = "adagrad"
    lr: float = 0.05
    embedding_lr: float = 0.05
    dim: int = 16
    bottom: str = "64"
    top: str = "64"
    data: str | None = None
    rows: int = 65536
    features: int = 8
    vocab: str = "2000"
    zipf: float = 1.1
    hash_capacity: int = 0
    val_fraction: float = 0.1
    eval_every: int = 50
    seed: int = 1234
    backend: str = "auto"
    run_dir: str = "runs/recsys"
    save_every: int = 0
    keep: int = 2
    resume: bool = False
    overwrite: bool = False
    log_every: int = 10

    @property
    def vocab_sizes(self) -> tuple[int, ...]:
        n = CRITEO_SPARSE if self.data else self.features
        sizes = _ints(self.vocab, "--vocab")
        return sizes * n if len(sizes) == 1 else sizes

    def model(self) -> DLRMConfig:
        return DLRMConfig(vocab=self.vocab_sizes, dim=self.dim,
                          bottom=_ints(self.bottom, "--bottom"), top=_ints(self.top, "--top"),
                          hash_capacity=self.hash_capacity)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ConfigError("invalid list of sizes", f"{flag} {text}",
                          "expected positive integers separated by commas", f"E.g. {flag} 64,32")
    return values


def check(cfg: RecsysConfig) -> RecsysConfig:
    positive = ("steps", "global_batch", "dim", "log_every")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ConfigError("option must be positive", f"--{name.replace('_', '-')}",
                              f"got {getattr(cfg, name)}", "Give a value of at least 1")
    if cfg.optimizer not in KINDS:
        raise ConfigError("unknown optimizer", f"--optimizer {cfg.optimizer}",
                          f"the choices are {', '.join(KINDS)}", "Pick one of them")
    vocab = cfg.vocab_sizes
    if not cfg.data and len(vocab) != cfg.features:
        raise ConfigError("vocabulary sizes do not match the features",
                          f"--vocab {cfg.vocab}", f"{len(vocab)} sizes for {cfg.features} "
                          "features", "Give one size, or one per feature")
    if not 0 < cfg.val_fraction < 1:
        raise ConfigError("validation fraction out of range", f"--val-fraction "
                          f"{cfg.val_fraction}", "it must lie strictly between 0 and 1",
                          "E.g. --val-fraction 0.1")
    for name in ("lr", "embedding_lr", "zipf"):
        if not math.isfinite(getattr(cfg, name)):
            raise ConfigError("option must be a finite number", f"--{name.replace('_', '-')} "
                              f"{getattr(cfg, name)}", "inf and nan train nothing",
                              "Give a finite value")
    if not 0 <= cfg.seed < 2**64:
        raise ConfigError("invalid seed", f"--seed {cfg.seed}", "it must be >= 0 and below "
                          "2**64 (a 64-bit seed)", "Pass a smaller --seed")
    if not cfg.data:  # the synthetic log's size is known now; a file's once it is read
        check_rows(cfg, cfg.rows - max(1, int(cfg.rows * cfg.val_fraction)))
    if cfg.overwrite and cfg.resume:
        raise ConfigError("--overwrite with --resume", "--overwrite --resume",
                          "--resume continues the checkpoints that --overwrite sets aside",
                          "Drop one of them")
    cfg.model()  # the MLP widths parse
    return cfg


def check_rows(cfg: RecsysConfig, train_rows: int) -> None:
    """Refuse a log with fewer training rows (after the validation split) than one step takes."""
    if train_rows < cfg.global_batch:
        source = f"--data {cfg.data}" if cfg.data else f"--rows {cfg.rows}"
        raise ConfigError("too few training rows for one step",
                          f"{source} --global-batch {cfg.global_batch}",
                          f"{max(train_rows, 0)} training row(s) after the --val-fraction "
                          f"{cfg.val_fraction} split, and every step takes {cfg.global_batch}",
                          "Give more rows, or a smaller --global-batch")


def check_world(cfg: RecsysConfig, world_size: int) -> None:
    if cfg.global_batch % world_size:
        raise ConfigError("global batch does not divide over the ranks",
                          f"--global-batch {cfg.global_batch}, {world_size} rank(s)",
                          "every rank takes an equal share of each step's rows",
                          f"Use a multiple of {world_size}")


def parse_args(argv: Sequence[str] | None = None, *, quiet: bool = False) -> RecsysConfig:
    """The config of the flags; ``quiet`` parses without printing (every rank but rank 0)."""
    parser = _Parser(prog="python -m trainer.recsys", quiet=quiet,
                     description="Train a DLRM click model on sharded embeddings.")
    for f in fields(RecsysConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help=HELP[f.name])
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            parser.add_argument(flag, type=kind, default=f.default, help=HELP[f.name])
    parsed = vars(parser.parse_args(argv))
    if parsed["backend"] not in BACKENDS:
        raise ConfigError("unknown communication backend", f"--backend {parsed['backend']}",
                          f"the backends are {', '.join(BACKENDS)}", "Pick one of them")
    cfg = check(RecsysConfig(**parsed))
    run_dir.check(Path(cfg.run_dir), resume=cfg.resume, overwrite=cfg.overwrite)
    return cfg
