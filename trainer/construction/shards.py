"""ZeRO-3's units built straight into shards: no rank materialises a whole unit at start-up.

A model built on the meta device (`trainer.construction.meta`, cut to the rank's pipeline
stage and TP slice) gets, for every unit of `trainer.parallel.zero.units` (a block, a run of
the root's parameters; the tied embedding under pipelining alone), a whole flat buffer whose
storage is resized to 0 bytes before anything is written to it, parameters that are views of
it (the same objects the rest of the run sees), and this rank's shard of it, zeros. The serial
initialisation is then streamed one parameter at a time (`materialise.local_stream`: the
same values, drawn in the same order, as a model built whole) and each value's overlap with
this rank's shards is copied in before the next is drawn. So construction holds the shards
plus one parameter's value, never a unit: ``peak_bytes`` counts exactly that, and
`trainer.parallel.zero.units.ParamUnits` adopts the buffers without gathering anything.
``--init-from-hf`` streams the folder's weights the same way, each parameter's TP slice read
on its own (`trainer.hf.folder.rank_slices`).

The layout is the one `trainer.parallel.zero.unit_grads.UnitGradients` computes from the same
parameters (reverse order, the same unit runs, the same shard group); `ParamUnits` checks
they agree. A checkpoint then loads into the shards directly (the optimizer's pieces are
views of them, `trainer.checkpoint.pieces` reads only the ranges a piece needs).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
from torch import nn

from trainer.construction.materialise import local_stream
from trainer.model.gpt import GPT
from trainer.parallel.zero.layout import unit_layout
from trainer.parallel.zero.unit_grads import unit_runs
from trainer.parallel.zero.units import UnitShards


def materialise_shards(model: GPT, seed: int, *, tp_rank: int, tp_size: int,
                       device: torch.device, dp_size: int, dp_rank: int,
                       alone: Collection[str] = (),
                       values: Iterable[tuple[str, torch.Tensor]] | None = None) -> UnitShards:
    """Give the meta ``model`` real parameters as views of freed unit buffers, and fill this
    rank's shards (DP rank ``dp_rank`` of the ``dp_size`` ranks sharding a unit) with its
    part of the serial initialisation, or of ``values``: (name, this rank's TP slice) of
    every parameter, one at a time (a Hugging Face folder's, `trainer.hf.folder.rank_slices`).
    ``alone``: parameter names that are units of their own (the tied embedding under
    pipelining)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad][::-1]
    names = [n for n, _ in named]
    where = {n: i for i, n in enumerate(names)}
    alone_at = [where[n] for n in alone if n in where]
    layout = unit_layout([p.numel() for _, p in named], unit_runs(names, alone_at),
                         dp_size, dp_rank)
    dtype = torch.get_default_dtype()
    unit_of = {i: k for k, b in enumerate(layout.buckets) for i in b.params}
    full, shards, made = [], [], {}
    for k, b in enumerate(layout.buckets):
        # One unit at a time: allocated, never written (on the CPU its pages are never
        # touched), and freed to 0 bytes as soon as its parameters' views exist (a view is
        # checked against the storage), before the next unit is allocated.
        buf = torch.empty(b.end - b.start, dtype=dtype, device=device)
        for i in b.params:
            old = named[i][1]
            at = layout.offsets[i] - b.start
            # Set through .data, as `ParamUnits` does: the parameter then keeps its own
            # version counter, so regathering the buffer in place never trips autograd.
            new = nn.Parameter(buf.new_empty(0), old.requires_grad)
            new.data = buf[at:at + old.numel()].view(old.shape)
            new.__dict__.update(old.__dict__)  # the shard spec and other attributes
            made[id(old)] = new
        buf.untyped_storage().resize_(0)
        full.append(buf)
        lo, hi = layout.shard(k)
        shards.append(torch.zeros(hi - lo, dtype=dtype, device=device))
    held = sum(s.numel() * s.element_size() for s in shards)
    peak = held
    with torch.no_grad():
        stream = local_stream(model, seed, tp_rank, tp_size) if values is None else values
        for name, value in stream:
            peak = max(peak, held + value.numel() * value.element_size())
            i = where[name]
            k, start = unit_of[i], layout.offsets[i]
            lo, hi = layout.shard(k)
            a, z = max(lo, start), min(hi, start + value.numel())
            if a < z:
                shards[k][a - lo:z - lo].copy_(value.reshape(-1)[a - start:z - start]
                                               .to(dtype))
            del value
    for module in model.modules():
        for key, current in list(module._parameters.items()):
            if current is not None and id(current) in made:
                module._parameters[key] = made[id(current)]
    cos, sin = model.rope_tables(model.cfg)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"still on the meta device: {left}")  # a wiring bug
    return UnitShards(layout, full, shards, peak)
