"""Options of ``python -m trainer.recsys``: a frozen, sectioned `RecsysConfig` from flags (and
``--config FILE``), through the same declarations and parser as the GPT trainer
(`trainer.schema`, `trainer.config.flags`), sharing its checkpoint and logging sections.

Checks that need no other rank (sizes, choices, the run dir: `trainer.checkpoint.run_dir`) run
here; those that need the world (the batch divides over the ranks) in `check_world`. Every
refusal names the flag and how to fix it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.checkpoint import run_dir
from trainer.comm.bootstrap import BACKENDS
from trainer.config.common import CheckpointSection, LoggingSection
from trainer.config.flags import option_table, parse
from trainer.errors import ConfigError
from trainer.recsys.data import CRITEO_SPARSE
from trainer.recsys.model import DLRMConfig
from trainer.schema import Section, option, replaced, section
from trainer.sparse import KINDS


@dataclass(frozen=True, kw_only=True)
class RecsysModel(Section):
    """The DLRM's widths and its embedding table's mode."""

    dim: int = option(16, "embedding width (and the bottom MLP's output)", at_least=1)
    bottom: str = option("64", "hidden widths of the bottom MLP, e.g. 64,32")
    top: str = option("64", "hidden widths of the top MLP")
    hash_capacity: int = option(0, "hash mode: rows per rank of an open-addressing table (0: "
                                "identity mode, sum(vocab) rows sharded over the ranks)",
                                at_least=0)

    def check(self) -> None:
        _ints(self.bottom, "--bottom")
        _ints(self.top, "--top")


@dataclass(frozen=True, kw_only=True)
class RecsysData(Section):
    """The click log: a Criteo file or the synthetic log, and how much of it per step."""

    path: str | None = option(None, "Criteo-format TSV file (label, 13 integers, 26 hex "
                              "categoricals); default: the synthetic click log", flag="data")
    rows: int = option(65536, "rows of the synthetic click log (or at most this many of --data; "
                       "0 = all)", at_least=0)
    features: int = option(8, "categorical features of the synthetic log", at_least=1)
    vocab: str = option("2000", "keys per categorical feature: one number for all, or one per "
                        "feature (Criteo keys are taken mod it); with --hash-capacity the keys "
                        "are used as they are")
    zipf: float = option(1.1, "power-law exponent of the synthetic keys' frequencies",
                         at_least=0)
    val_fraction: float = option(0.1, "hold out this last fraction of the rows for validation",
                                 above=0, below=1)
    global_batch: int = option(256, "click-log rows per step, summed over the ranks (must "
                               "divide by them)", at_least=1)

    @property
    def vocab_sizes(self) -> tuple[int, ...]:
        n = CRITEO_SPARSE if self.path else self.features
        sizes = _ints(self.vocab, "--vocab")
        return sizes * n if len(sizes) == 1 else sizes

    def check(self) -> None:
        vocab = self.vocab_sizes
        if not self.path and len(vocab) != self.features:
            raise ConfigError("vocabulary sizes do not match the features",
                              f"--vocab {self.vocab}", f"{len(vocab)} sizes for "
                              f"{self.features} features", "Give one size, or one per feature")
        if not self.path:  # the synthetic log's size is known now; a file's once it is read
            check_rows(self, self.rows - max(1, int(self.rows * self.val_fraction)))


@dataclass(frozen=True, kw_only=True)
class RecsysOptimizer(Section):
    """The update rule of the embeddings and the MLPs."""

    kind: str = option("adagrad", "rule for the embeddings and the MLPs: sgd, adagrad or adam "
                       "(lazy per-row Adam for the embeddings)", flag="optimizer", choices=KINDS)
    lr: float = option(0.05, "learning rate of the MLPs", at_least=0)
    embedding_lr: float = option(0.05, "learning rate of the embedding rows", at_least=0)


@dataclass(frozen=True, kw_only=True)
class RecsysConfig(Section):
    """One recommender run."""

    steps: int = option(200, "optimizer steps in total (a resumed run stops at the same step)",
                        at_least=1)
    seed: int = option(1234, "seed of the synthetic log, initialisation and batch order",
                       at_least=0, below=2**64)
    backend: str = option("auto", "communication backend: auto (nccl on GPU, else mpi), mpi or "
                          "nccl", choices=BACKENDS)
    run_dir: str = option("runs/recsys", "folder for checkpoints, metrics.jsonl, loss.png and "
                          "auc.png")
    model: RecsysModel = section(RecsysModel, "the DLRM")
    data: RecsysData = section(RecsysData, "the click log")
    optimizer: RecsysOptimizer = section(RecsysOptimizer, "the optimizer")
    checkpoint: CheckpointSection = section(CheckpointSection, "checkpoints")
    logging: LoggingSection = section(LoggingSection, "logging and evaluation")

    def dlrm(self) -> DLRMConfig:
        return DLRMConfig(vocab=self.data.vocab_sizes, dim=self.model.dim,
                          bottom=_ints(self.model.bottom, "--bottom"),
                          top=_ints(self.model.top, "--top"),
                          hash_capacity=self.model.hash_capacity)

    def with_options(self, **changes: Any) -> RecsysConfig:
        """This config with the options named by flag changed (checked again)."""
        return replaced(self, changes, OPTIONS)


OPTIONS = option_table(RecsysConfig)
"""Every option of a recommender run by flag name."""


def make_config(**options: Any) -> RecsysConfig:
    """A checked config from options by flag name."""
    return RecsysConfig().with_options(**options)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ConfigError("invalid list of sizes", f"{flag} {text}",
                          "expected positive integers separated by commas", f"E.g. {flag} 64,32")
    return values


def check_rows(data: RecsysData, train_rows: int) -> None:
    """Refuse a log with fewer training rows (after the validation split) than one step
    takes."""
    if train_rows < data.global_batch:
        source = f"--data {data.path}" if data.path else f"--rows {data.rows}"
        raise ConfigError("too few training rows for one step",
                          f"{source} --global-batch {data.global_batch}",
                          f"{max(train_rows, 0)} training row(s) after the --val-fraction "
                          f"{data.val_fraction} split, and every step takes "
                          f"{data.global_batch}", "Give more rows, or a smaller --global-batch")


def check_world(cfg: RecsysConfig, world_size: int) -> None:
    if cfg.data.global_batch % world_size:
        raise ConfigError("global batch does not divide over the ranks",
                          f"--global-batch {cfg.data.global_batch}, {world_size} rank(s)",
                          "every rank takes an equal share of each step's rows",
                          f"Use a multiple of {world_size}")


def parse_args(argv: Sequence[str] | None = None, *, quiet: bool = False) -> RecsysConfig:
    """The config of the flags; ``quiet`` parses without printing (every rank but rank 0)."""
    cfg = parse(RecsysConfig, argv, prog="python -m trainer.recsys", quiet=quiet,
                description="Train a DLRM click model on sharded embeddings.")
    run_dir.check(Path(cfg.run_dir), resume=cfg.checkpoint.resume,
                  overwrite=cfg.checkpoint.overwrite)
    return cfg
