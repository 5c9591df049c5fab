"""Deterministic, resumable, DP-sharded batches of tokenized datasets, blended by weight.

Samples. A dataset's shards (`trainer.data.token_files`) are cut into windows of seq_len+1
tokens starting every seq_len tokens (the last token of one window is the first of the next,
as the target of its last input), shard by shard; the last ``val_fraction`` of the windows
(the end of the last shards) is the held-out split, never trained on.

Order. Dataset d's training windows are visited epoch by epoch, each epoch a pseudo-random
permutation of all of them (a Feistel network keyed by (seed, d, epoch), walked until it lands
inside the range: O(1) memory whatever the dataset's size, no window repeated or skipped within
an epoch). Blending (``--data a:0.7,b:0.3``) follows Megatron's rule: global sample i comes from
the dataset furthest behind its share, argmax_d(w_d·(i+1) - taken_d), so every prefix of the
run holds each dataset within one sample of its weight.

Position. The global batch of a step is the next ``global_batch`` samples of that sequence;
DP rank r takes its contiguous slice (`trainer.data.batches.BatchPlan`). The position, samples
taken in all and per dataset (`Position`), is all the state there is: saved in a checkpoint and
restored, the run continues with exactly the samples it would have seen, at any dp.
Validation batch k is the same whatever the position: the held-out windows in order, blended
by the same rule from sample 0.

Documents. With ``documents`` (``--document-mask``) each microbatch carries a third tensor, the
document ids of its windows (`trainer.model.documents.document_ids`, from the datasets' EOS id),
computed on the whole window before ``keep`` cuts inputs and targets to this rank's part.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from trainer.data.batches import BatchPlan, Keep, Microbatch, kept, step_seed
from trainer.data.corpus import DataError
from trainer.data.token_files import TOKENIZER, TokenFiles
from trainer.model.documents import document_ids


def _hash(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """A splitmix64-style mix of uint64 values with ``key`` (wrapping multiplication)."""
    x = (x ^ key) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(31))) * np.uint64(0x94D049BB133111EB)
    mixed: np.ndarray = x ^ (x >> np.uint64(29))
    return mixed


def permute(index: np.ndarray, n: int, key: int, rounds: int = 4) -> np.ndarray:
    """A pseudo-random permutation of range(n) applied to ``index`` (values < n).

    An unbalanced Feistel network on the ``bits`` = bit_length(n - 1) bits of an index: the
    high part (``hi`` bits) and the low part (``lo`` bits) trade places every round, the new
    low part being the old high part xor a keyed hash of the old low part, so each round is a
    bijection of [0, 2^bits). An even number of rounds restores the split. Values that land
    at n or above go round again (cycle walking); the domain is below 2n, so fewer than two
    passes on average."""
    bits = max(1, (n - 1).bit_length())
    sizes = (bits // 2, bits - bits // 2)  # (hi, lo)
    keys = [np.uint64(step_seed(key, r)) for r in range(rounds)]
    out = index.astype(np.uint64)
    todo = np.ones(out.shape, dtype=bool)
    with np.errstate(over="ignore"):
        while todo.any():
            x = out[todo]
            hi_bits, lo_bits = sizes
            for r in range(rounds):
                hi, lo = x >> np.uint64(lo_bits), x & np.uint64((1 << lo_bits) - 1)
                new_lo = (hi ^ _hash(lo, keys[r])) & np.uint64((1 << hi_bits) - 1)
                x = (lo << np.uint64(hi_bits)) | new_lo
                hi_bits, lo_bits = lo_bits, hi_bits
            out[todo] = x
            todo = out >= np.uint64(n)
    return out


@dataclass(frozen=True)
class Source:
    """One dataset of a blend: its files and how its windows split into train and held out."""

    files: TokenFiles
    seq_len: int
    val_fraction: float
    starts: np.ndarray = field(init=False)
    """Cumulative windows per shard (shards + 1 values)."""

    def __post_init__(self) -> None:
        per_shard = [max(0, (s.tokens - 1) // self.seq_len) for s in self.files.manifest.shards]
        object.__setattr__(self, "starts", np.concatenate([[0], np.cumsum(per_shard)]))
        if self.train < 1 or (self.val_fraction > 0 and self.val < 1):
            raise DataError("tokenized dataset too small", str(self.files.folder),
                            f"{int(self.starts[-1])} windows of {self.seq_len + 1} tokens, "
                            f"{self.val} of them held out", "Use more data, a smaller --seq-len"
                            " or a smaller --val-fraction")

    @property
    def val(self) -> int:
        total = int(self.starts[-1])
        return max(0, min(total - 1, max(1, int(total * self.val_fraction)))) \
            if self.val_fraction else 0

    @property
    def train(self) -> int:
        return int(self.starts[-1]) - self.val

    def _by_shard(self, index: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(shard, where in ``index``, token offsets) of windows number ``index``."""
        index = index.astype(np.int64)
        shard = np.searchsorted(self.starts, index, side="right") - 1
        for s in np.unique(shard):
            at = shard == s
            yield int(s), at, (index[at] - self.starts[s]) * self.seq_len

    def verify(self, index: np.ndarray) -> None:
        """Check the blocks of windows number ``index`` (`TokenFiles.verify`)."""
        for shard, _, starts in self._by_shard(index):
            self.files.verify(shard, starts, self.seq_len + 1)

    def windows(self, index: np.ndarray) -> np.ndarray:
        """Windows number ``index`` (train windows first, then the held-out ones) as an
        (n, seq_len + 1) int64 array, in the order asked."""
        out = np.empty((len(index), self.seq_len + 1), dtype=np.int64)
        for shard, at, starts in self._by_shard(index):
            out[at] = self.files.gather(shard, starts, self.seq_len + 1)
        return out


def check_same_tokenizer(datasets: list[TokenFiles]) -> None:
    """Refuse a blend of datasets made by different tokenizers (their ids mean other tokens)."""
    first = datasets[0]
    for other in datasets[1:]:
        if other.manifest.files[TOKENIZER]["sha256"] != first.manifest.files[TOKENIZER]["sha256"]:
            raise DataError("blended datasets have different tokenizers",
                            f"--data {first.folder} and {other.folder}",
                            "their token ids stand for different text",
                            "Prepare every blended dataset with the same --tokenizer")


def check_document_ends(datasets: list[TokenFiles]) -> int:
    """The EOS id that ends every document of ``datasets`` (for ``--document-mask``), refused
    when they disagree or it is not an id of their vocabulary."""
    ids = {d.manifest.eos_id for d in datasets}
    first = datasets[0]
    if len(ids) > 1 or not 0 <= first.manifest.eos_id < first.manifest.vocab_size:
        found = ", ".join(f"{d.folder}: {d.manifest.eos_id}" for d in datasets)
        raise DataError("no single end-of-document token", f"--document-mask --data [{found}]",
                        "document masking tells documents apart by one EOS id inside the "
                        f"vocabulary of {first.manifest.vocab_size} ids",
                        "Prepare every dataset with the same tokenizer and --eos, or drop "
                        "--document-mask")
    return first.manifest.eos_id


@dataclass
class Position:
    """Samples taken so far, in all and from each dataset: the loader's whole state."""

    samples: int = 0
    taken: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {"samples": self.samples, "taken": list(self.taken)}


def choose(weights: list[float], position: Position, count: int) -> list[int]:
    """The datasets of the next ``count`` samples (advancing ``position``)."""
    if len(weights) == 1:
        position.samples += count
        position.taken[0] += count
        return [0] * count
    out = []
    for _ in range(count):
        i = position.samples
        d = max(range(len(weights)), key=lambda k: weights[k] * (i + 1) - position.taken[k])
        position.taken[d] += 1
        position.samples += 1
        out.append(d)
    return out


CHUNK = 4096
"""Samples of a dataset whose windows are permuted at once (32 KiB of indices)."""


class TokenBatches:
    """Microbatches of one DP rank, step after step, from a blend of tokenized datasets."""

    def __init__(self, blend: list[tuple[Path, float]], *, seq_len: int, plan: BatchPlan,
                 seed: int, dp_rank: int, model_vocab: int, val_fraction: float = 0.0,
                 device: torch.device | str = "cpu", validation: bool = False,
                 reporter: bool = True, keep: Keep | None = None,
                 documents: bool = False) -> None:
        self.keep = keep
        """The part of each window this rank trains on (`trainer.data.batches.Keep`)."""
        total = sum(w for _, w in blend)
        self.weights = [w / total for _, w in blend]
        self.sources = [Source(TokenFiles(path, model_vocab=model_vocab), seq_len, val_fraction)
                        for path, _ in blend]
        check_same_tokenizer([s.files for s in self.sources])
        self.eos_id = check_document_ends([s.files for s in self.sources]) if documents \
            else None
        """The EOS id the windows' document ids are counted by (None: no document masking)."""
        self.seq_len, self.plan, self.seed, self.dp_rank = seq_len, plan, seed, dp_rank
        self.device, self.validation = torch.device(device), validation
        self.reporter = reporter
        """Whether this rank prints a damaged block's error (every rank raises it)."""
        self.position = Position(0, [0] * len(blend))
        self._step: int | None = None
        self._cached: list[Microbatch] = []
        self._chunks: dict[int, tuple[int, np.ndarray]] = {}
        """Per dataset, the last chunk of permuted window numbers (`_chunk`)."""

    def restore(self, state: dict[str, object], step: int) -> None:
        """Continue from a saved `Position` (``Position.to_dict``) at the start of ``step``."""
        taken = [int(t) for t in state["taken"]]  # type: ignore[attr-defined]
        if len(taken) != len(self.sources):
            raise DataError("data position does not match the datasets", "--data",
                            f"the checkpoint blended {len(taken)} dataset(s), this run "
                            f"{len(self.sources)}", "Resume with the --data of the saved run")
        self.position = Position(int(state["samples"]), taken)  # type: ignore[call-overload]
        self._step, self._cached = step - 1, []

    def _index(self, source: int, number: np.ndarray) -> np.ndarray:
        """The window numbers of dataset ``source``'s samples ``number`` (counted per
        dataset)."""
        src = self.sources[source]
        if self.validation:
            return src.train + number % np.uint64(src.val)
        chunk = number // np.uint64(CHUNK)
        chosen = np.empty_like(number)
        for c in np.unique(chunk):
            at = chunk == c
            chosen[at] = self._chunk(source, int(c))[number[at] - c * np.uint64(CHUNK)]
        return chosen

    def _chunk(self, source: int, c: int) -> np.ndarray:
        """The window numbers of dataset ``source``'s samples ``c·CHUNK .. (c+1)·CHUNK``,
        permuted together and kept until the run moves on: one vectorised permutation per
        `CHUNK` samples instead of a few dozen small NumPy calls per step."""
        kept = self._chunks.get(source)
        if kept is not None and kept[0] == c:
            return kept[1]
        src = self.sources[source]
        number = np.arange(c * CHUNK, (c + 1) * CHUNK, dtype=np.uint64)
        epoch, offset = np.divmod(number, np.uint64(src.train))
        chosen = np.empty_like(offset)
        for e in np.unique(epoch):  # one permutation per epoch the chunk touches
            at = epoch == e
            chosen[at] = permute(offset[at], src.train, step_seed(self.seed, source, int(e)))
        self._chunks[source] = (c, chosen)
        return chosen

    def _rows(self, position: Position, count: int) -> np.ndarray:
        """This DP rank's rows of the ``count`` samples after ``position`` (advanced past
        all of them); only those rows are read, but the blocks of all of them are verified:
        a damaged block then stops every rank at the same step, and one of them says so."""
        first = list(position.taken)
        picks = np.asarray(choose(self.weights, position, count))
        index = np.empty(count, dtype=np.uint64)  # each sample's window in its dataset
        for d, start in enumerate(first):
            at = picks == d
            index[at] = self._index(d, start + np.arange(int(at.sum()), dtype=np.uint64))
        try:
            for d in np.unique(picks):
                self.sources[d].verify(index[picks == d])
        except DataError as err:
            raise err.everywhere(report=self.reporter) from None
        local = self.plan.local_slice(self.dp_rank)
        picks, index = picks[local], index[local]
        rows = np.empty((len(picks), self.sources[0].seq_len + 1), dtype=np.int64)
        for d in np.unique(picks):
            at = picks == d
            rows[at] = self.sources[d].windows(index[at])
        return rows

    def microbatches(self, step: int) -> list[Microbatch]:
        """This rank's microbatches of ``step``: training steps come in order (a step asked
        again gives the same batch); validation batch ``step`` from anywhere."""
        if not self.validation and step == self._step:
            return self._cached
        if self.validation:  # from sample 0, so batch k never depends on the run's position
            position = Position(0, [0] * len(self.sources))
            choose(self.weights, position, step * self.plan.global_batch)
        else:
            if self._step is not None and step != self._step + 1:
                raise RuntimeError(f"step {step} asked after step {self._step}")  # a loop bug
            position = self.position
        batch = torch.from_numpy(self._rows(position, self.plan.global_batch))
        if self.device.type != "cpu":
            batch = batch.to(self.device, non_blocking=True)
        micro: list[Microbatch] = [kept((rows[:, :-1], rows[:, 1:]), self.keep)
                                   for rows in batch.split(self.plan.micro_batch_size)]
        if self.eos_id is not None:  # on the whole windows, before keep cuts them
            micro = [(*part, document_ids(rows[:, :-1], self.eos_id))
                     for part, rows in zip(micro, batch.split(self.plan.micro_batch_size),
                                           strict=True)]
        if not self.validation:
            self._step, self._cached = step, micro
        return micro
