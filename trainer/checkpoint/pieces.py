"""A run's trained state as slices of global tensors: what a rank saves, and what it reads back,
at any layout (`trainer.placement`).

What a rank's optimizer steps (its parameters, their fp32 main copies, or its ZeRO-1 pieces)
are `Held` tensors, each with its `Placement` and its AdamW moments. A save writes the slices
this rank is the writer of (`trainer.placement.writers`: one writer per slice, spread over
the ranks that hold it), each flattened, under ``<kind>/<global name>`` (kinds: ``param``,
``exp_avg``, ``exp_avg_sq``); the index records every slice's placement. A load asks, for each
tensor of the new placement, which saved slices overlap it (`trainer.placement.copies`), opens
only the files that hold them, reads from each only the range it needs (memory-mapped), and
copies the overlaps in: no rank ever holds a saved tensor it does not own, beyond one piece.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import bounds
from trainer.checkpoint.direct import ALIGN
from trainer.checkpoint.files import FileRecord, TensorFile
from trainer.checkpoint.layout import FALLBACK_HINT, CheckpointDamaged
from trainer.checkpoint.load import read_index, read_meta
from trainer.placement import Copy, Placement, copies, placement_of

PARAM, MOMENTS = "param", ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Held:
    """One tensor a rank's optimizer steps, where it lies, and its optimizer state."""

    tensor: torch.Tensor
    placement: Placement
    moments: dict[str, torch.Tensor]


def held(stepped: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[Held]:
    """The stepped tensors (each carrying ``.placement``) with their AdamW moments."""
    return [Held(t, placement_of(t), {k: v for k, v in optimizer.state.get(t, {}).items()
                                      if k in MOMENTS}) for t in stepped]


def adam_step(optimizer: torch.optim.Optimizer) -> int:
    """AdamW's step count on this rank (0: no state yet)."""
    return max((int(s["step"]) for s in optimizer.state.values() if "step" in s), default=0)


def stage(tensors: Sequence[Held], writes: Sequence[bool],
          pool: dict[str, torch.Tensor] | None = None
          ) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """A copy, on the CPU, of every slice this rank writes (``writes``: for each held tensor,
    `trainer.placement.writers`), and the index entries that describe them: (tensors by key,
    contents). ``pool``: host tensors kept from the previous save (written already), copied
    into instead of allocating, pinned when the state is on CUDA: after the first save, staging
    is one copy, with no allocation or page faults (the background writer's). Host copies of a
    CPU state are allocated as one page-aligned block, in the order the file holds them, so the
    writer sends them to the disk from where they lie (`trainer.checkpoint.direct`)."""
    pairs, contents = staging(tensors, writes, pool)
    out = {key: host.copy_(flat, non_blocking=flat.is_cuda) for key, (host, flat) in pairs.items()}
    if any(h.tensor.is_cuda for h in tensors):
        torch.cuda.synchronize()  # the pinned copies are complete before anyone reads them
    return out, contents


def staging(tensors: Sequence[Held], writes: Sequence[bool],
            pool: dict[str, torch.Tensor] | None = None
            ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[Any]]:
    """`stage` without the copy: for every key, the host tensor and what is to be copied
    into it, and the index entries (a background writer copies, `trainer.checkpoint.save`)."""
    sources: dict[str, torch.Tensor] = {}
    contents: list[Any] = []
    for h, mine in zip(tensors, writes, strict=True):
        if not mine:
            continue
        for kind, value in ((PARAM, h.tensor), *sorted(h.moments.items())):
            key = f"{kind}/{h.placement.name}"
            sources[key] = value.detach().reshape(-1)
            contents.append({"kind": kind, "key": key, **h.placement.to_json()})
    hosts = dict(pool) if pool is not None else {}
    if any(key not in hosts or hosts[key].shape != flat.shape or hosts[key].dtype != flat.dtype
           for key, flat in sources.items()):
        hosts |= _allocate(sources)
        if pool is not None:
            pool.update(hosts)
    return {key: (hosts[key], flat) for key, flat in sources.items()}, contents


def _allocate(sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Empty host tensors shaped as ``sources``: pinned, one each, for a CUDA state; else
    views of one page-aligned block, back to back in this order (each at an offset its dtype
    can start at: the block is cut as the file's data is only while they all line up)."""
    if any(flat.is_cuda for flat in sources.values()):
        return {key: torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                for key, flat in sources.items()}
    sizes = [flat.numel() * flat.element_size() for flat in sources.values()]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    if any(at % flat.element_size() for at, flat in zip(starts, sources.values(), strict=True)):
        return {key: torch.empty_like(flat) for key, flat in sources.items()}
    raw = torch.empty(sum(sizes) + ALIGN, dtype=torch.uint8)
    block = raw[-raw.data_ptr() % ALIGN:][:sum(sizes)]
    return {key: block[at:at + n].view(flat.dtype)
            for (key, flat), at, n in zip(sources.items(), starts, sizes, strict=True)}


@dataclass(frozen=True)
class Read:
    """Copy ``copies`` of saved flat tensor ``key`` into target number ``slot`` (flat)."""

    key: str
    slot: int
    copies: tuple[Copy, ...]


@dataclass
class ReadPlan:
    """The saved slices one rank reads, file by file, and the files it opened (verified)."""

    reads: dict[str, list[Read]] = field(default_factory=dict)
    opened: dict[str, TensorFile] = field(default_factory=dict)

    def bytes(self, record: dict[str, FileRecord]) -> int:
        return sum(record[name].size for name in self.opened)


def slices_index(path: Path, record: dict[str, FileRecord]) -> dict[str, Any]:
    """The verified ``index.json`` of ``path``, every entry checked against the tensor files
    before any number in it is planned or allocated with (`trainer.checkpoint.bounds`)."""
    index = read_index(path, record)
    bounds.check(path, index, record)
    return index


def plan(path: Path, index: dict[str, Any], record: dict[str, FileRecord],
         targets: Sequence[tuple[str, Placement]]) -> ReadPlan:
    """Where every target (its kind and placement) comes from; opens and verifies the files
    that hold any of it. Raises `CheckpointDamaged` when the index lacks part of a target (a
    file or an entry missing). ``index``: `slices_index`'s, checked."""
    saved: dict[tuple[str, str], list[tuple[str, str, Placement]]] = {}
    for name, entries in index["files"].items():
        for e in entries or ():
            saved.setdefault((e["kind"], e["name"]), []).append(
                (name, e["key"], Placement.from_json(e)))
    out = ReadPlan()
    for slot, (kind, want) in enumerate(targets):
        found, limit = 0, _overlap_end(want, saved.get((kind, want.name), []))
        for file, key, have in saved.get((kind, want.name), []):
            moves = copies(want, have, limit)
            if moves:
                out.reads.setdefault(file, []).append(Read(key, slot, tuple(moves)))
                found += sum(c.elements for c in moves)
        if found < _expected(want, limit):
            raise CheckpointDamaged(
                f"checkpoint {path} is incomplete", f"{kind} of {want.name}",
                f"its index holds {found:,} of the {_expected(want, limit):,} elements this "
                "rank needs (a tensor file or its entries are missing)", FALLBACK_HINT)
    for file in sorted(out.reads):
        out.opened[file] = TensorFile(path, file, record)
    return out


def _overlap_end(want: Placement, saved: list[tuple[str, str, Placement]]) -> int | None:
    """Where the saved rows end when the saved tensor has fewer rows than this run's (a
    vocabulary padded to another multiple); None when the shapes are the same."""
    if not saved or saved[0][2].shape == want.shape:
        return None
    have = saved[0][2].shape
    if have[1:] != want.shape[1:]:
        raise CheckpointDamaged(f"tensor {want.name} has another shape",
                                f"checkpoint {list(have)}, this run {list(want.shape)}",
                                "only the rows of a padded vocabulary may differ", FALLBACK_HINT)
    return min(have[0], want.shape[0]) * math.prod(want.shape[1:])


def _expected(want: Placement, limit: int | None) -> int:
    """The elements of ``want`` that a checkpoint must hold (those below ``limit``)."""
    if limit is None:
        return want.numel
    probe = Placement(want.name, want.shape, want.tp, want.flat)
    return sum(c.elements for c in copies(probe, Placement(want.name, want.shape), limit))


@torch.no_grad()
def read(plan: ReadPlan, targets: Sequence[torch.Tensor]) -> None:
    """Fill every target (flat, in `plan`'s order), one saved slice at a time, reading from
    each file (memory-mapped) only the range of each slice that holds what this rank needs."""
    for file, reads in plan.reads.items():
        for r in reads:
            _fill(targets[r.slot], plan.opened[file], r)


def _fill(target: torch.Tensor, source: TensorFile, r: Read) -> None:
    """Do read ``r`` from ``source`` into ``target`` (flat): only the range of the saved slice
    that holds what the target needs is read."""
    lo = min(c.src_at for c in r.copies)
    hi = max(c.src_end for c in r.copies)
    data = source.read(r.key, lo, hi)
    for c in r.copies:
        _move(target, data, c, lo)


def _move(dst: torch.Tensor, src: torch.Tensor, c: Copy, src_base: int) -> None:
    """Do ``c`` from ``src`` (flat, holding the source from element ``src_base``) into ``dst``
    (flat and contiguous), its rows as one strided copy."""
    at = c.src_at - src_base
    if c.count == 1:
        dst[c.dst_at:c.dst_at + c.n].copy_(src[at:at + c.n])
        return
    rows = (c.count, c.n)
    dst[c.dst_at:].as_strided(rows, (c.dst_step, 1)).copy_(
        src[at:].as_strided(rows, (c.src_step, 1)))


def install(optimizer: torch.optim.Optimizer, tensors: Sequence[Held],
            moments: Sequence[dict[str, torch.Tensor]], step: int,
            groups: Sequence[dict[str, Any]]) -> None:
    """Put the read moments and AdamW's step count into ``optimizer``'s state, and the saved
    hyperparameters into its groups (as torch's ``load_state_dict`` would)."""
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for h, saved in zip(tensors, moments, strict=True):
        if step and saved:
            on_device = group_of[id(h.tensor)].get("fused") or \
                group_of[id(h.tensor)].get("capturable")
            optimizer.state[h.tensor] = {
                "step": torch.tensor(float(step), dtype=torch.float32 if on_device else dtype,
                                     device=h.tensor.device if on_device else "cpu"),
                **saved}
    for group, hyper in zip(optimizer.param_groups, groups, strict=True):
        group.update({k: tuple(v) if k == "betas" else v for k, v in hyper.items()})


class Assembler:
    """The whole global tensors of ``kind`` that checkpoint ``path`` holds (only ``names``,
    when given), put together from their slices one tensor at a time: the index is read and
    every file holding one of them opened and verified once, here; each call then reads only
    the slices of the tensors it asks for (a merge for one process, or an export that streams
    tensor by tensor, `trainer.export`)."""

    def __init__(self, path: Path, kind: str = PARAM, names: Sequence[str] | None = None
                 ) -> None:
        record, _ = read_meta(path)
        index = slices_index(path, record)
        self.shapes: dict[str, tuple[int, ...]] = {}
        """Every tensor's global shape, by name."""
        first: dict[str, tuple[str, str]] = {}
        for file, entries in index["files"].items():
            for e in entries or ():
                if e["kind"] == kind and (names is None or e["name"] in names):
                    self.shapes.setdefault(e["name"], tuple(e["shape"]))
                    first.setdefault(e["name"], (file, e["key"]))
        self._plan = plan(path, index, record,
                          [(kind, Placement(n, s)) for n, s in self.shapes.items()])
        self._reads: dict[int, list[tuple[str, Read]]] = {}
        for file, reads in self._plan.reads.items():
            for r in reads:
                self._reads.setdefault(r.slot, []).append((file, r))
        self._slot = {name: slot for slot, name in enumerate(self.shapes)}
        # Allocated in the saved slices' dtype (the files are open and verified by now).
        self.dtypes = {name: self._plan.opened[file].read(key, 0, 0).dtype
                       for name, (file, key) in first.items()}

    @torch.no_grad()
    def __call__(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The whole tensors ``names``, each read from the slices that hold it."""
        out = {}
        for name in names:
            whole = out[name] = torch.empty(self.shapes[name], dtype=self.dtypes[name])
            for file, r in self._reads.get(self._slot[name], []):
                _fill(whole.view(-1), self._plan.opened[file], r)
        return out


def assemble(path: Path, kind: str = PARAM,
             names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """Every whole global tensor of ``kind`` the checkpoint ``path`` holds (only ``names``,
    when given), by name (`Assembler`: a merge that reads every file that holds one, each
    verified; for one process that wants them whole)."""
    tensors = Assembler(path, kind, names)
    return tensors(list(tensors.shapes))
