"""Which transformer layers each pipeline stage runs (pure: no torch, no communication).

A pipeline of ``p`` ranks with ``v`` chunks per rank has ``S = p * v`` stages, stage ``s`` on
rank ``s % p`` as chunk ``s // p`` (`trainer.parallel.pipeline.actions`). The GPT's ``n_layer``
blocks
are cut into S contiguous runs, in order: stage 0 also embeds the tokens, stage S-1 also runs
the final norm, the head and the loss.

Balanced by layer count: every stage gets ``n_layer // S`` layers and the remainder goes one
layer each to the middle stages first, then to stage 0, and to the last stage only when every
other stage already has one more (the last stage also computes the vocabulary projection and
the loss, the most expensive non-layer work; the embedding of stage 0 is a cheap lookup).
Example: 7 layers over 4 stages is ``2,2,2,1``.

An override (``--pp-layers 3,2,2,1``) gives the count of every stage. The first and the last
stage may get 0 layers (they still embed / compute the loss); a middle stage may not, since it
would have nothing to run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainer.errors import ConfigError


def parse_counts(text: str) -> tuple[int, ...]:
    """``"3,2,2,1"`` -> (3, 2, 2, 1); ``""`` -> () (no override)."""
    if not text.strip():
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError("invalid option", f"--pp-layers {text}",
                          "it must be comma-separated layer counts, one per pipeline stage",
                          "Write it like --pp-layers 3,2,2,1") from None


def balanced_counts(n_layer: int, stages: int) -> tuple[int, ...]:
    """Layer counts per stage, as even as possible (see the module docstring for the order)."""
    base, extra = divmod(n_layer, stages)
    counts = [base] * stages
    order = [*range(1, stages - 1), 0, stages - 1] if stages > 1 else [0]
    for s in order[:extra]:
        counts[s] += 1
    return tuple(counts)


def stage_counts(n_layer: int, p: int, v: int, override: Sequence[int] = ()) -> tuple[int, ...]:
    """Layer counts of the ``p * v`` stages: the override checked, or the balanced split."""
    stages = p * v
    where = f"n_layer={n_layer}, pp={p}, virtual stages={v}"
    if not override:
        if n_layer < stages:
            raise ConfigError(
                "layers do not split over the pipeline stages", where,
                f"{n_layer} layer(s) cannot fill pp*v = {stages} stages with one layer each",
                f"Use at least {stages} layers (--n-layer), a smaller --pp or --virtual-stages, "
                "or give per-stage counts with --pp-layers")
        return balanced_counts(n_layer, stages)
    counts = tuple(override)
    shown = f"--pp-layers {','.join(str(c) for c in counts)}"
    if len(counts) != stages:
        raise ConfigError("layers do not split over the pipeline stages", shown,
                          f"it gives {len(counts)} count(s) but pp*v = {p}*{v} = {stages} "
                          "stages need one each", f"Give {stages} comma-separated counts")
    if sum(counts) != n_layer:
        raise ConfigError("layers do not split over the pipeline stages", shown,
                          f"the counts add up to {sum(counts)} but the model has {n_layer} "
                          "layers", f"Make them add up to {n_layer}")
    empty = [s for s, c in enumerate(counts) if c < 0 or (c == 0 and 0 < s < stages - 1)]
    if empty:
        raise ConfigError("layers do not split over the pipeline stages", shown,
                          f"stage(s) {', '.join(str(s) for s in empty)} would run no layer "
                          "(only the first and the last stage may have 0)",
                          "Give every middle stage at least one layer")
    return counts


@dataclass(frozen=True)
class StageLayout:
    """The layers of every stage, and which of them one pipeline rank runs."""

    p: int
    v: int
    rank: int
    counts: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def stage(self, chunk: int) -> int:
        """The stage this rank runs as ``chunk`` (chunk c of rank r is stage c*p + r)."""
        return chunk * self.p + self.rank

    def layers_of_stage(self, stage: int) -> range:
        start = sum(self.counts[:stage])
        return range(start, start + self.counts[stage])

    def layers(self, chunk: int) -> range:
        """Global layer indices of this rank's ``chunk``, in order."""
        return self.layers_of_stage(self.stage(chunk))

    def owned_layers(self) -> list[int]:
        """Every global layer index this rank holds (all of its chunks)."""
        return [i for c in range(self.v) for i in self.layers(c)]

    def is_first(self, chunk: int) -> bool:
        return self.stage(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.stage(chunk) == self.num_stages - 1

    @property
    def holds_first(self) -> bool:
        """This rank runs stage 0 (the embedding)."""
        return self.rank == 0

    @property
    def holds_last(self) -> bool:
        """This rank runs the last stage (final norm, head, loss)."""
        return self.rank == self.p - 1


def describe(counts: Sequence[int]) -> str:
    """``[2, 2, 1]`` -> ``"0-1|2-3|4"``: the layer ranges of the stages, for logs."""
    parts, start = [], 0
    for c in counts:
        parts.append("-" if c == 0 else str(start) if c == 1 else f"{start}-{start + c - 1}")
        start += c
    return "|".join(parts)
