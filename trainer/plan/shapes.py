"""A rank's parameters and activations, taken from the trainer's own model code without
allocating it: the rank's model is built on the meta device and sharded by the trainer's own
`parallelize` (parameter counts), and one microbatch runs forward under torch's fake tensors
with the saved-tensor meter `bench.memory` uses (`trainer.parallel.zero.memory.SavedTensorMeter`:
activation bytes). So the plan follows the model as it is, padding, fused weights, sequence
parallelism and recomputation included.

Activations grow linearly with the layers a rank runs: a model of one block and one of two give
the bytes of a block and of what is not a block (embedding, final norm, head and loss).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import cache
from typing import TYPE_CHECKING, cast

import torch

from trainer.comm.protocol import DoneHandle, Handle, P2POp, ReduceOp
from trainer.model.config import GPTConfig

if TYPE_CHECKING:  # imported where used: `dtrain plan` starts without the model's imports
    from trainer.model.gpt import GPT
    from trainer.parallel.context.attention import Exchange
from trainer.parallel.zero.memory import SavedTensorMeter


class ShapeComm:
    """A communicator of ``size`` members that moves nothing: what building and running a
    model on meta or fake tensors needs (shapes only). Its collectives leave their outputs as
    they are, which is right for tensors without data."""

    def __init__(self, size: int, rank: int = 0, name: str = "tp") -> None:
        self._size, self._rank, self._name = size, rank, name
        self.steps = 0
        """Message steps its calls took under ring algorithms (`trainer.plan.operations`):
        2(n-1) an all-reduce, n-1 an all-gather, reduce-scatter or all-to-all, 1 a send."""

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def name(self) -> str:
        return self._name

    @property
    def backend(self) -> str:
        return "shape"

    def _ring(self, steps: int, async_op: bool) -> Handle | None:
        self.steps += steps
        return DoneHandle() if async_op else None

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False) -> Handle | None:
        return self._ring(2 * (self._size - 1), async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *,
                   async_op: bool = False) -> Handle | None:
        return self._ring(self._size - 1, async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                       *, async_op: bool = False) -> Handle | None:
        return self._ring(self._size - 1, async_op)

    def broadcast(self, t: torch.Tensor, src: int, *, async_op: bool = False) -> Handle | None:
        return self._ring(self._size - 1, async_op)

    def send(self, t: torch.Tensor, dst: int) -> None:
        self.steps += 1

    def recv(self, t: torch.Tensor, src: int) -> None:
        return None

    def batch_p2p(self, ops: Sequence[P2POp]) -> list[Handle]:
        self.steps += len(ops)
        return [DoneHandle() for _ in ops]

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, *,
                   in_splits: Sequence[int] | None = None,
                   out_splits: Sequence[int] | None = None,
                   async_op: bool = False) -> Handle | None:
        return self._ring(self._size - 1, async_op)

    def barrier(self) -> None:
        return None

    def split(self, color: int, key: int, *, name: str = "") -> ShapeComm:
        return ShapeComm(self._size, self._rank, name or self._name)


@dataclass(frozen=True)
class StageParams:
    """The parameters one pipeline rank holds at tp rank 0 (the largest shard)."""

    dense: int
    """Parameters every data-parallel rank holds."""
    expert: int
    """Parameters of MoE experts, before they are split over ep."""


def _counts(cfg: GPTConfig, pp: int, v: int) -> tuple[int, ...]:
    from trainer.parallel.pipeline.partition import stage_counts

    return stage_counts(cfg.n_layer, pp, v)


@dataclass(frozen=True)
class RankParams:
    """One pipeline rank's parameters at tp rank 0, as the trainer's gradient sync lists them."""

    names: tuple[str, ...]
    numels: tuple[int, ...]
    """In the gradient buffer's order (`trainer.parallel.data.grad_sync`: reverse order of
    ``named_parameters``, each shared parameter once)."""
    alone: tuple[int, ...]
    """Indices (buffer order) of the parameters ZeRO gives a bucket of their own: the tied
    embedding under PP (`trainer.parallel.pipeline.stages.tied_weight`)."""


@cache
def rank_params(cfg: GPTConfig, *, tp: int, pp: int, v: int = 1) -> tuple[RankParams, ...]:
    """Each pipeline rank's parameters: the trainer's stage model on the meta device, sharded
    over a tp group of ``tp``."""
    from trainer.construction.meta import meta_gpt
    from trainer.parallel.pipeline.partition import StageLayout
    from trainer.parallel.pipeline.stages import tied_weight
    from trainer.parallel.tensor.parallelize import parallelize

    out: list[RankParams] = []
    for rank in range(pp):
        layout = StageLayout(pp, v, rank, _counts(cfg, pp, v)) if pp > 1 else None
        model = parallelize(meta_gpt(cfg, 0, layout), ShapeComm(tp))
        tied = tied_weight(model, layout) if layout else None
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad][::-1]
        out.append(RankParams(tuple(n for n, _ in named), tuple(p.numel() for _, p in named),
                              tuple(i for i, (_, p) in enumerate(named) if p is tied)))
    return tuple(out)


@cache
def stage_params(cfg: GPTConfig, *, tp: int, pp: int, v: int = 1) -> tuple[StageParams, ...]:
    """Each pipeline rank's parameters (`rank_params`), dense and experts apart."""
    out: list[StageParams] = []
    for rank in rank_params(cfg, tp=tp, pp=pp, v=v):
        expert = sum(n for name, n in zip(rank.names, rank.numels, strict=True)
                     if ".experts." in name)
        out.append(StageParams(sum(rank.numels) - expert, expert))
    return tuple(out)


@dataclass(frozen=True)
class Activations:
    """Bytes saved for backward by one microbatch on one rank. Autograd saves some parameters
    too (a matrix product keeps its weight); the meter counts their storage once, however many
    microbatches are in flight, so they are apart."""

    per_block: int
    """One transformer block's activations."""
    rest: int
    """The activations of everything else: embedding, final norm, head, loss."""
    weights_per_block: int
    """The parameter bytes one block saves (once per rank)."""
    weights_rest: int
    """The parameter bytes the rest saves (once per rank)."""
    expert_row_bytes: float = 0.0
    """A mixture of experts: the bytes saved per row an expert runs (its MLP's activations,
    the combine's), measured from the rows two capacities keep (`activations`)."""
    expert_rows: float = 0.0
    """The rows the experts of one MoE block ran in the measurement (random tokens, the
    initial router): ``per_block`` holds them, a run's routing moves it by
    ``expert_row_bytes`` per row (`trainer.plan.routing.measured_rows`)."""


def _to_bf16(model: torch.nn.Module) -> None:
    """``model.to(torch.bfloat16)`` for fake parameters, which `Module.to` cannot swap in
    place: new parameters, shared ones (a tied head) still shared."""
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in done:
                done[id(p)] = torch.nn.Parameter(p.detach().to(torch.bfloat16), p.requires_grad)
            setattr(module, name, done[id(p)])


@dataclass(frozen=True)
class RankModel:
    """How one rank's model is set up (`rank_model`): the run's options that shape it."""

    tp: int
    sequence_parallel: bool
    recompute: str
    micro_batch: int
    dtype: str = "fp32"
    cp: int = 1
    exchange: str = "allgather"


@contextmanager
def rank_model(cfg: GPTConfig, how: RankModel
               ) -> Iterator[tuple[GPT, torch.Tensor, list[ShapeComm]]]:
    """The trainer's model of ``cfg``, sharded and set up as a rank of the run ``how`` (on a cp
    rank's share of the sequence, its attention the context-parallel exchange), and one
    microbatch of tokens: on fake tensors, or for a mixture of experts, which routes by the
    data, on real ones (random weights and tokens: routing as at initialisation). Also the tp
    and cp communicators it was given (they count the collectives it calls)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    from trainer.activations import apply_recompute, apply_sequence_parallel
    from trainer.model.family import build_model
    from trainer.parallel.context.model import context_parallel
    from trainer.parallel.tensor.parallelize import parallelize
    from trainer.parallel.tensor.random import TP_RNG, RNGStatesTracker

    class RealStates(RNGStatesTracker):
        """Random states kept real under the fake mode, so that recomputation in backward can
        put them back (a generator takes no fake state)."""

        def get_states(self) -> dict[str, torch.Tensor]:
            with unset_fake_temporarily():
                return super().get_states()

        def set_states(self, states: dict[str, torch.Tensor]) -> None:
            with unset_fake_temporarily():
                super().set_states(states)

    tracker = RealStates("cpu")
    tracker.seed(TP_RNG, 0)  # the stream a step seeds; outside the fake mode: real state
    mode: AbstractContextManager[object] = (
        nullcontext() if cfg.moe.experts else FakeTensorMode(allow_non_fake_inputs=True))
    with mode:
        model = build_model(cfg, seed=0)
        if how.dtype == "bf16":
            _to_bf16(model)
        comms = [ShapeComm(how.tp), ShapeComm(how.cp, 0, "cp")]
        model = parallelize(model, comms[0], tracker=tracker)
        if how.sequence_parallel:
            model = apply_sequence_parallel(model, comms[0], tracker)
        model = apply_recompute(model, how.recompute, tracker)
        if how.cp > 1:
            model = context_parallel(model, comms[1], cast("Exchange", how.exchange))
        tokens = cfg.seq_len // how.cp
        idx = (torch.randint(0, cfg.vocab_size, (how.micro_batch, tokens),
                             generator=torch.Generator().manual_seed(0))
               if cfg.moe.experts else torch.zeros(how.micro_batch, tokens, dtype=torch.long))
        yield model, idx, comms


@cache
def activations(cfg: GPTConfig, *, tp: int, sequence_parallel: bool, recompute: str,
                micro_batch: int, dtype: str = "fp32", cp: int = 1,
                exchange: str = "allgather") -> Activations:
    """One microbatch's saved bytes: the trainer's model of one and of two blocks
    (`rank_model`), forward and loss under the meter."""
    check_measurable(cfg)
    how = RankModel(tp, sequence_parallel, recompute, micro_batch, dtype, cp, exchange)

    def measure(small: GPTConfig) -> tuple[int, int, int]:
        """(activation bytes, weight bytes, expert rows) saved by ``small``'s forward."""
        with rank_model(small, how) as (model, idx, _):
            meter = SavedTensorMeter(frozenset(p.untyped_storage()._cdata
                                               for p in model.parameters()))
            rows = _expert_rows(model)
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                model.loss(idx, idx)
            return meter.peak - meter.weight_bytes, meter.weight_bytes, sum(rows)

    (one, w_one, rows_one), (two, w_two, rows_two) = (
        measure(replace(cfg, n_layer=layers)) for layers in (1, 2))
    block, weight = two - one, w_two - w_one
    slope, rows = 0.0, float(rows_two - rows_one)
    if cfg.moe.experts:  # half the capacity: fewer rows, the rest alike
        fewer = replace(cfg, n_layer=1, moe=replace(cfg.moe,
                                                    capacity_factor=cfg.moe.capacity_factor / 2))
        half, _, rows_half = measure(fewer)
        slope = (one - half) / (rows_one - rows_half) if rows_one != rows_half else 0.0
    # What is not a block holds no expert rows: the 1-block model's rows are its block's.
    rest = one - block - round(slope * (rows_one - rows))
    return Activations(per_block=block, rest=rest, weights_per_block=weight,
                       weights_rest=w_one - weight, expert_row_bytes=slope, expert_rows=rows)


def _expert_rows(model: torch.nn.Module) -> list[int]:
    """Counts (appended as forward runs) of the rows every expert of ``model`` runs."""
    from trainer.parallel.expert.layer import moe_layers

    counts: list[int] = []
    for _, layer in moe_layers(model):
        for expert in layer.experts.values():
            expert.register_forward_pre_hook(
                lambda _m, args: counts.append(int(args[0].shape[0])))
    return counts


MOE_REAL_BYTES = 4 * 2**30
"""The most parameter bytes the real 2-block model of an MoE plan may take on this machine."""


def check_measurable(cfg: GPTConfig) -> None:
    """Refuse an MoE model whose 2-block model (run for real to measure) is too large, and one
    without a capacity, whose rows per expert have no bound."""
    from trainer.errors import ConfigError

    if not cfg.moe.experts:
        return
    if cfg.moe.capacity_factor <= 0:
        raise ConfigError("cannot plan a mixture of experts without a capacity",
                          f"--moe-experts {cfg.moe.experts}", "without --moe-capacity-factor "
                          "the rows an expert gets have no bound", "Give a capacity factor "
                          "(e.g. --moe-capacity-factor 1.25), as the run should")
    params = sum(s.dense + s.expert for s in stage_params(replace(cfg, n_layer=2), tp=1, pp=1))
    if 4 * params > MOE_REAL_BYTES:
        raise ConfigError("cannot plan this mixture of experts here",
                          f"--moe-experts {cfg.moe.experts}", f"measuring its activations runs "
                          f"2 blocks for real ({4 * params / 2**30:.1f} GiB of weights)",
                          "Plan a narrower model of the same depth, or the dense model")
