"""Click logs for the recommender: a planted synthetic log, Criteo TSV files, batches per step.

A `ClickLog` is three tensors: ``dense`` (N, 13) float, ``sparse`` (N, F) int64 keys (key k of
feature f), ``labels`` (N,) in {0, 1}. ``vocab`` gives each feature's key range in identity mode
(0 for raw keys, hash mode only).

`synthetic` is generated deterministically from the seed, in fixed chunks, so the same seed and
size give the same log on every rank and every machine: dense features N(0, 1); the keys of
feature f follow a power law (Zipf exponent ``zipf``: key rank r is drawn with probability
proportional to 1/(r+1)^zipf, ranks then scattered over the vocabulary by a fixed permutation so
hot keys land on every owner); labels are drawn from a planted logistic model, logit = w·dense +
Σ_f b_f[key_f] + c. ``truth`` keeps the planted click probability of every row: the AUC of the
truth on the validation rows is the ceiling a model can reach.

`read_criteo` reads Criteo-format TSV (``label, 13 integers, 26 hex categoricals``; empty fields
allowed): integers become log(1 + max(x, 0)), a categorical's hex value is its key (mod the
feature's vocabulary in identity mode, as is, for hash mode, when ``vocab`` is 0); an empty
categorical is key 0. Malformed lines fail naming file:line.

`Batches` gives the global batch of a step as a pure function of (seed, step): an epoch-wise
permutation of the training rows, so a resumed run reads the same batches; every rank takes its
contiguous 1/G slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from trainer.errors import ConfigError, TrainerError

DENSE = 13
CRITEO_SPARSE = 26
_CHUNK = 8192  # rows generated per chunk of the synthetic log (each chunk its own generator)


class DataError(TrainerError):
    """A click log cannot be read or does not fit the model."""


@dataclass(frozen=True)
class ClickLog:
    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor
    vocab: tuple[int, ...]
    source: str
    truth: torch.Tensor | None = None
    """Planted click probability per row (synthetic logs only)."""

    def __len__(self) -> int:
        return len(self.labels)

    def rows(self, index: torch.Tensor | slice) -> ClickLog:
        truth = self.truth[index] if self.truth is not None else None
        return ClickLog(self.dense[index], self.sparse[index], self.labels[index], self.vocab,
                        self.source, truth)

    def split(self, val_fraction: float) -> tuple[ClickLog, ClickLog]:
        """(training rows, validation rows): the last ``val_fraction`` is held out."""
        n_val = max(1, int(len(self) * val_fraction))
        if n_val >= len(self):
            raise ConfigError("validation split leaves no training rows", self.source,
                              f"{len(self)} rows, val_fraction {val_fraction}",
                              "Use more rows or a smaller --val-fraction")
        cut = len(self) - n_val
        return self.rows(slice(0, cut)), self.rows(slice(cut, None))


@dataclass(frozen=True)
class Planted:
    """The ground-truth logistic model of a synthetic log."""

    dense_w: torch.Tensor
    key_w: list[torch.Tensor]
    bias: float


def planted_model(vocab: tuple[int, ...], seed: int) -> Planted:
    gen = torch.Generator().manual_seed(seed)
    dense_w = torch.randn(DENSE, generator=gen, dtype=torch.float64) * 0.4
    key_w = [torch.randn(v, generator=gen, dtype=torch.float64) * 0.8 for v in vocab]
    return Planted(dense_w, key_w, -1.0)


def synthetic(n: int, vocab: tuple[int, ...], *, seed: int, zipf: float = 1.1) -> ClickLog:
    """``n`` rows of the planted click log of ``seed`` (see the module docstring)."""
    truth_model = planted_model(vocab, seed)
    gen = torch.Generator().manual_seed((seed + 1) % 2**64)
    scatter = [torch.randperm(v, generator=gen) for v in vocab]
    probs = [1.0 / torch.arange(1, v + 1, dtype=torch.float64) ** zipf for v in vocab]
    parts = [_chunk(seed, c, min(_CHUNK, n - c * _CHUNK), probs, scatter)
             for c in range(math.ceil(n / _CHUNK))]
    dense = torch.cat([p[0] for p in parts])
    sparse = torch.cat([p[1] for p in parts])
    uniform = torch.cat([p[2] for p in parts])
    logit = dense.double() @ truth_model.dense_w + truth_model.bias
    for f, weights in enumerate(truth_model.key_w):
        logit = logit + weights[sparse[:, f]]
    truth = torch.sigmoid(logit)
    labels = (uniform < truth).to(torch.float32)
    return ClickLog(dense, sparse, labels, vocab, f"synthetic(seed={seed}, rows={n})",
                    truth.float())


def _chunk(seed: int, index: int, rows: int, probs: list[torch.Tensor],
           scatter: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed((seed * 1_000_003 + index + 2) % 2**64)
    dense = torch.randn(rows, DENSE, generator=gen)
    keys = [perm[torch.multinomial(p, rows, replacement=True, generator=gen)]
            for p, perm in zip(probs, scatter, strict=True)]
    uniform = torch.rand(rows, generator=gen, dtype=torch.float64)
    return dense, torch.stack(keys, dim=1), uniform


def read_criteo(path: Path, vocab: tuple[int, ...], *, limit: int = 0) -> ClickLog:
    """A Criteo-format TSV file (at most ``limit`` rows, 0 = all); ``vocab`` has 26 entries,
    each a feature's key range (keys taken mod it) or 0 (raw keys, for hash mode)."""
    if len(vocab) != CRITEO_SPARSE:
        raise ConfigError("wrong number of vocabulary sizes for Criteo data", str(path),
                          f"{len(vocab)} given, Criteo rows have {CRITEO_SPARSE} categoricals",
                          f"Give {CRITEO_SPARSE} sizes in --vocab (or one, used for all)")
    labels: list[float] = []
    dense: list[list[float]] = []
    sparse: list[list[int]] = []
    try:
        with open(path, encoding="ascii") as fh:
            for number, line in enumerate(fh, 1):
                if limit and len(labels) >= limit:
                    break
                label, ints, cats = _criteo_line(line, f"{path}:{number}")
                labels.append(label)
                dense.append(ints)
                sparse.append([c % v if v else c for c, v in zip(cats, vocab, strict=True)])
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError("cannot read the click log", str(path), str(exc),
                        "Check the path given to --data") from None
    if not labels:
        raise DataError("click log is empty", str(path), "no rows", "Give a non-empty file")
    raw = torch.tensor(dense, dtype=torch.float64)
    return ClickLog(torch.log1p(raw.clamp(min=0)).float(), torch.tensor(sparse, dtype=torch.int64),
                    torch.tensor(labels, dtype=torch.float32), vocab, str(path))


def _criteo_line(line: str, where: str) -> tuple[float, list[float], list[int]]:
    fields = line.rstrip("\n").split("\t")
    if len(fields) != 1 + DENSE + CRITEO_SPARSE:
        raise DataError("malformed Criteo line", where,
                        f"{len(fields)} tab-separated fields, expected {1 + DENSE + CRITEO_SPARSE}",
                        "Give label, 13 integers and 26 hex categoricals per line")
    try:
        label = float(int(fields[0]))
        ints = [float(int(x)) if x else 0.0 for x in fields[1:1 + DENSE]]
        cats = [int(x, 16) if x else 0 for x in fields[1 + DENSE:]]
    except ValueError as exc:
        raise DataError("malformed Criteo line", where, str(exc),
                        "Integers must be decimal, categoricals hexadecimal") from None
    if label not in (0.0, 1.0):
        raise DataError("malformed Criteo line", where, f"label {fields[0]!r} is not 0 or 1",
                        "Put the click label (0 or 1) first")
    return label, ints, cats


@dataclass(frozen=True)
class Batches:
    """Global batches of ``batch`` training rows per step; rank ``rank`` of ``size`` gets its
    contiguous slice. Steps are 1-based."""

    log: ClickLog
    batch: int
    seed: int
    rank: int = 0
    size: int = 1

    def at(self, step: int) -> ClickLog:
        n = len(self.log)
        per_epoch = n // self.batch
        epoch, index = divmod(step - 1, per_epoch)
        rows = _epoch_order(self.seed, epoch, n)[index * self.batch:(index + 1) * self.batch]
        share = self.batch // self.size
        return self.log.rows(rows[self.rank * share:(self.rank + 1) * share])


@lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed((seed * 7919 + epoch) % 2**64)  # any 64-bit seed
    return torch.randperm(n, generator=gen)
