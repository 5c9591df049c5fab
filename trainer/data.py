"""Byte-level language-model data: a corpus every host has, and deterministic DP-sharded batches.

Corpus. By default the Python standard library's own source files (``sysconfig`` "stdlib"
path): present on every host without a download, sorted by relative path and concatenated, so
every rank that runs the same Python reads the same bytes. ``--data PATH`` names a text file or
a folder (every regular file under it, sorted). The corpus is capped (``cap_bytes``) so start-up
stays fast; ``Corpus.fingerprint`` lets the ranks check that they all read the same bytes.

Sampling. The global batch of step ``s`` is ``global_batch`` random windows whose start offsets
come from a generator seeded with (seed, s) alone. DP rank r takes the r-th contiguous slice of
``global_batch / dp`` windows and cuts it into microbatches. Consequences: the data position of
a run is just its step (resume needs no loader state), DP ranks never overlap, and any dp size
sees the same global batch, so a run can be resumed with a different dp.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.errors import TrainerError

DEFAULT_CAP_BYTES = 8 * 1024 * 1024
_SEPARATOR = b"\n\n"


class DataError(TrainerError):
    """The corpus cannot be read or is too small for the sequence length."""


@dataclass(frozen=True)
class Corpus:
    """The training bytes, as a uint8 tensor, plus where they came from."""

    tokens: torch.Tensor
    source: str

    @property
    def fingerprint(self) -> str:
        """sha256 of the bytes (first 16 hex digits): same value on every rank or data differs."""
        return hashlib.sha256(self.tokens.numpy().tobytes()).hexdigest()[:16]

    def __len__(self) -> int:
        return int(self.tokens.numel())


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path) -> Iterator[Path]:
    """Files under ``root`` in a host-independent order, lazily (reading stops at the cap).

    Depth first; in each folder its files by name, then its subfolders by name; hidden entries
    (``.git``, ``.DS_Store``) are skipped. For the default stdlib corpus only ``.py`` files count
    and ``site-packages`` is skipped, so what a user installed into the interpreter does not
    change the data."""
    if root.is_file():
        yield root
        return
    stdlib = root == stdlib_dir()
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs
                            if d not in ("site-packages", "__pycache__") and d[0] != ".")
        for name in sorted(names):
            if name[0] != "." and (not stdlib or name.endswith(".py")):
                yield Path(folder, name)


def load_corpus(path: str | None = None, *, cap_bytes: int = DEFAULT_CAP_BYTES) -> Corpus:
    """Read up to ``cap_bytes`` of text from ``path`` (default: the stdlib sources)."""
    root = stdlib_dir() if path is None else Path(path).expanduser()
    if not root.exists():
        raise DataError("data path not found", str(root), "it does not exist",
                        "Pass --data with a text file or folder present on every host")
    chunks: list[bytes] = []
    total = 0
    for file in corpus_files(root):
        try:
            raw = file.read_bytes()
        except OSError:
            continue  # unreadable files (sockets, permission) are skipped, deterministically
        chunks.append(raw + _SEPARATOR)
        total += len(raw) + len(_SEPARATOR)
        if total >= cap_bytes:
            break
    data = b"".join(chunks)[:cap_bytes]
    return Corpus(torch.frombuffer(bytearray(data), dtype=torch.uint8), str(root))


def _mix(*values: int) -> int:
    """Combine integers into one 63-bit seed (splitmix64 steps), so (seed, step) streams
    for neighbouring steps are unrelated."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 29
    return x & 0x7FFFFFFFFFFFFFFF


def step_seed(seed: int, step: int, *streams: int) -> int:
    """The seed of step ``step`` for an independent random stream (0 = data, others free)."""
    return _mix(seed, step, *streams)


def window_starts(seed: int, step: int, *, global_batch: int, seq_len: int,
                  corpus_len: int) -> torch.Tensor:
    """Start offsets (global_batch,) of the windows of step ``step``; a function of its inputs."""
    high = corpus_len - seq_len - 1
    if high < 1:
        raise DataError("corpus too small", f"{corpus_len} bytes",
                        f"a training window needs seq_len+1 = {seq_len + 1} bytes and a choice "
                        "of start offsets", "Use a bigger --data or a smaller seq_len")
    gen = torch.Generator(device="cpu").manual_seed(step_seed(seed, step, 0))
    return torch.randint(0, high, (global_batch,), generator=gen)


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch is divided: ``global_batch = dp * microbatches * micro_batch_size``."""

    global_batch: int
    dp: int
    microbatches: int

    def __post_init__(self) -> None:
        if self.global_batch % (self.dp * self.microbatches):
            raise ValueError(
                f"global batch {self.global_batch} is not divisible by dp*microbatches "
                f"({self.dp}*{self.microbatches}={self.dp * self.microbatches})")

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch // (self.dp * self.microbatches)

    def local_slice(self, dp_rank: int) -> slice:
        per_rank = self.global_batch // self.dp
        return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


class ShardedBatches:
    """Microbatches of one DP rank for any step, computed on demand (no iterator state)."""

    def __init__(self, corpus: Corpus, *, seq_len: int, plan: BatchPlan, seed: int,
                 dp_rank: int, device: torch.device | str = "cpu") -> None:
        self.tokens, self.seq_len, self.plan = corpus.tokens, seq_len, plan
        self.seed, self.dp_rank, self.device = seed, dp_rank, torch.device(device)
        window_starts(seed, 0, global_batch=1, seq_len=seq_len, corpus_len=len(corpus))
        self._offsets = torch.arange(seq_len + 1)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole batch of ``step`` (inputs, targets), each (global_batch, seq_len)."""
        starts = window_starts(self.seed, step, global_batch=self.plan.global_batch,
                               seq_len=self.seq_len, corpus_len=len(self.tokens))
        return self._windows(starts)

    def microbatches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's microbatches of ``step``, in order, each (micro_batch_size, seq_len)."""
        starts = window_starts(self.seed, step, global_batch=self.plan.global_batch,
                               seq_len=self.seq_len, corpus_len=len(self.tokens))
        local = starts[self.plan.local_slice(self.dp_rank)]
        return [self._windows(part) for part in local.split(self.plan.micro_batch_size)]

    def _windows(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.tokens[starts[:, None] + self._offsets].long()
        x, y = rows[:, :-1], rows[:, 1:]
        if self.device.type != "cpu":
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return x, y
