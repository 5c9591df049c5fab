"""Switch a ZeRO-3 model to tensor-parallel generation and back, in memory, without a
checkpoint (DeepSpeed's Hybrid Engine: PPO's rollouts between training steps).

    from trainer.inference.switch import generate_tp
    ids = generate_tp(run.model, run.weights.units, prompt, tp=2, tokens=32, temperature=0)

Under ``--zero 3`` a rank holds 1/dp of every unit (`trainer.parallel.zero.units`), and
sampling from the shards would gather every unit for every token. `tp_generation` instead
regathers the model once into a tensor-parallel layout over the same ranks: the dp ranks
split into groups of ``tp`` consecutive ranks, each group one TP model (`parallelize`), each
rank its TP shard. The units are gathered one at a time, each rank copies its TP slices of the
unit's parameters (`trainer.parallel.tensor.sharding.shard_tensor`) and the unit is freed
again, so the peak on top of training is one TP shard of the model plus one unit. The model is
built on the meta device and only its TP shard allocated; its buffers (RoPE tables) are the
training model's. Sampling is `trainer.inference.sampling` on that model, its head's logits
gathered over the group.

Leaving the context frees the generation model and its communicator. Nothing of the training
state is written: the shards, the optimizer state and the gradient shards are read only, every
unit ends freed as it was between steps, and the global random state is restored (building a
model draws nothing, sampling uses its own generator), so training continues exactly as if
the switch had not happened (tests/trainer/test_generation_switch.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from trainer.comm.protocol import Communicator
from trainer.construction.meta import meta_gpt
from trainer.errors import ConfigError
from trainer.inference.sampling import sample_ids
from trainer.model.gpt import GPT
from trainer.parallel.tensor.parallelize import check_divisible, parallelize
from trainer.parallel.tensor.random import TP_RNG, RNGStatesTracker
from trainer.parallel.tensor.sharding import shard_spec, shard_tensor
from trainer.parallel.zero.units import ParamUnits


def check_layout(tp: int, dp: int) -> None:
    """``tp``-way groups must tile the ``dp`` ranks."""
    if tp < 1 or dp % tp:
        raise ConfigError("invalid generation layout", f"tp {tp} over dp {dp}",
                          "the tensor-parallel groups are formed from the data-parallel "
                          "ranks, so tp must divide dp", f"Pass a tp that divides {dp}")


def check_switch(model: GPT, units: ParamUnits, tp: int) -> None:
    """Refuse a generation layout the ranks or the model cannot form, before anything is
    built."""
    if not isinstance(units, ParamUnits):  # a mixture of experts' units (zero/split.py)
        raise ConfigError("unsupported combination", "the generation switch with a mixture-"
                          "of-experts model", "the switch splits dense blocks only",
                          "Sample it on one process (trainer.generate without --from-run)")
    check_layout(tp, units.comm.size)
    if units.held or units.pending:
        raise ConfigError("generation switch inside a step", f"{len(units.held)} unit(s) "
                          "gathered", "the switch regathers the model between training "
                          "steps, when every unit is sharded",
                          "Call it after train_step returns, not from a hook")
    check_divisible(model.cfg, tp)


@contextmanager
def tp_generation(model: GPT, units: ParamUnits, tp: int) -> Iterator[GPT]:
    """The ZeRO-3 ``model`` regathered as this rank's shard of a ``tp``-way tensor-parallel
    model (ranks ``tp * g`` .. ``tp * g + tp - 1`` of the data-parallel group form group
    ``g``); freed, with its communicator, on exit."""
    check_switch(model, units, tp)
    dp = getattr(units.comm, "inner", units.comm)  # untimed: generation is not a step's comm
    group = dp.split(dp.rank // tp, dp.rank % tp, name=f"generation-tp{tp}")
    try:
        with torch.random.fork_rng(devices=[]):
            gen = _regather(model, units, group)
        try:
            yield gen
        finally:  # freed even if the caller still holds the model
            for t in [*gen.parameters(), *gen.buffers()]:
                t.untyped_storage().resize_(0)
    finally:
        close = getattr(group, "close", None)  # MPI frees its communicators (collective)
        if close is not None:
            close()


def _regather(model: GPT, units: ParamUnits, group: Communicator) -> GPT:
    """Build this rank's TP shard of ``model`` and fill it unit by unit."""
    first = next(model.parameters())
    tracker = None
    if model.cfg.dropout > 0:  # parallelize wants the stream; in eval no mask is drawn from it
        tracker = RNGStatesTracker(first.device)
        tracker.seed(TP_RNG, 0)
    gen = parallelize(meta_gpt(model.cfg).to(first.dtype), group, tracker=tracker)
    specs = {name: shard_spec(p) for name, p in gen.named_parameters()}  # to_empty drops them
    gen = gen.to_empty(device=first.device).eval()
    if model.cfg.tied and gen.head is not None and gen.tok_emb is not None:
        gen.head.weight = gen.tok_emb.weight  # to_empty made each module its own parameter
    with torch.no_grad():
        for name, buf in model.named_buffers():  # the RoPE tables: derived, not trained
            gen.get_buffer(name).copy_(buf)
    if gen.head is not None and group.size > 1:  # every rank of the group samples alike
        gen.head.gather_output, gen.vocab_start = True, 0  # type: ignore[assignment]  # ours
    wanted = dict(gen.named_parameters())
    unit_of = {f.untyped_storage()._cdata: k for k, f in enumerate(units.full)}
    by_unit: dict[int, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for name, p in model.named_parameters():
        if name in wanted:
            by_unit.setdefault(unit_of[p.untyped_storage()._cdata], []).append(
                (name, p, wanted.pop(name)))
    if wanted:  # a parameter the training model does not have: never left unfilled
        raise ConfigError("generation model does not match the training model",
                          ", ".join(sorted(wanted)[:3]), "these parameters have no values "
                          "in the training model's units", "Switch the model it was built from")
    with torch.no_grad():
        for k in range(len(units.full)):
            units._ensure(k)
            try:
                for name, full, local in by_unit.get(k, []):
                    spec = specs[name]
                    local.copy_(full if spec is None or group.size == 1 else
                                shard_tensor(full, group.rank, group.size, spec))
            finally:
                units._free(k)
    return gen


def generate_tp(model: GPT, units: ParamUnits, prompt: list[int], *, tp: int, tokens: int,
                temperature: float = 1.0, top_k: int = 0, seed: int = 0) -> list[int]:
    """``tokens`` ids continuing ``prompt``, sampled from the ZeRO-3 ``model`` switched to a
    ``tp``-way tensor-parallel layout and back (`tp_generation`). Every rank of a TP group
    must pass the same prompt and seed; the groups may sample different prompts."""
    with tp_generation(model, units, tp) as gen:
        return sample_ids(gen, prompt, tokens=tokens, temperature=temperature, top_k=top_k,
                          seed=seed)
