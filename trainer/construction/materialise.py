"""Give a model built on the meta device its real parameters: this rank's slices of the serial
initialisation, drawn in pieces (`trainer.construction.init_stream`)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from trainer.construction.init_stream import followed_by_zeros, normal_pieces, shard_of_stream
from trainer.construction.meta import meta_gpt
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT, drawn_rows, init_rule
from trainer.parallel.tensor.sharding import ShardSpec, shard_shape, shard_spec


def serial_name(name: str, cfg: GPTConfig) -> str:
    """The serial parameter a local one is initialised from: the last pipeline stage's copy of
    a tied head starts as the embedding (`trainer.parallel.pipeline.stages`)."""
    return "tok_emb.weight" if cfg.tied and name == "head.weight" else name


def local_values(model: GPT, seed: int, tp_rank: int, tp_size: int
                 ) -> dict[str, torch.Tensor]:
    """Every local parameter's initial value (CPU, default dtype), by local name."""
    return dict(local_stream(model, seed, tp_rank, tp_size))


def local_stream(model: GPT, seed: int, tp_rank: int, tp_size: int
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(local name, initial value) of every local parameter, one at a time (so a caller that
    keeps only part of each, ZeRO-3's shards, never holds more than one). The serial
    model's weights are walked in `GPT.init_weights` order and every draw is made (a weight
    this rank does not hold is drawn and dropped), so the generator stays in step; padded
    vocabulary rows are zeros, never drawn, as there."""
    cfg = model.cfg
    wanted: dict[str, list[tuple[str, ShardSpec | None]]] = {}
    for name, p in model.named_parameters():
        wanted.setdefault(serial_name(name, cfg), []).append((name, shard_spec(p)))
    serial = meta_gpt(cfg)  # names, shapes and order only: no memory
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = torch.get_default_dtype()  # what the serial init's randn draws in
    for name, p in serial.named_parameters():
        fill, std = init_rule(name, cfg.n_layer)
        targets = wanted.get(name, [])
        if not std:
            for local, spec in targets:
                shape = shard_shape(p.shape, spec, tp_size)
                yield local, torch.full(shape, fill, dtype=dtype)
            continue
        row = p.shape[1:].numel()
        rows = drawn_rows(name, p.shape[0], cfg)
        pieces = normal_pieces(rows * row, gen, dtype)
        if not targets:  # another stage's weight: draw it, piece by piece, and drop it
            for _ in pieces:
                pass
            continue
        if len({spec for _, spec in targets}) > 1:
            raise RuntimeError(f"{name} is held with two different shardings")  # a wiring bug
        pieces = followed_by_zeros(pieces, (p.shape[0] - rows) * row, dtype)
        shard = shard_of_stream(pieces, p.shape, targets[0][1], tp_rank, tp_size)
        for local, _ in targets:
            yield local, shard * std


def materialise(model: GPT, seed: int, tp_rank: int, tp_size: int,
                device: torch.device) -> GPT:
    """Replace every meta parameter of ``model`` by a real one on ``device`` holding its initial
    value, in place; tied parameters stay one object, attributes (the shard spec) are kept."""
    values = local_values(model, seed, tp_rank, tp_size)
    names = {id(p): name for name, p in model.named_parameters()}
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, old in list(module._parameters.items()):
            if old is None:
                continue
            if id(old) not in made:
                new = nn.Parameter(values[names[id(old)]].to(device), old.requires_grad)
                new.__dict__.update(old.__dict__)
                made[id(old)] = new
            module._parameters[key] = made[id(old)]
    cos, sin = model.rope_tables(model.cfg)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"still on the meta device: {left}")  # a new buffer not handled here
    return model
