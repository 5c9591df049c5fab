"""One training run as a rank holds it: model, gradient sync, main weights, step body, data.

`build_run(cfg, mesh)` assembles it (the same code for every layout) and chooses, once, what
varies between layouts: the step body (plain accumulation or a pipeline schedule,
`trainer.training.body`) and the holder of the main weights (the model's fp32 parameters, fp32
copies of a bf16 model, or ZeRO-1's pieces, `trainer.optim.main_weights`). `trainer.train`
steps it with `trainer.training.step.run_step`, which reads straight through.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from trainer.comm.bootstrap import World
from trainer.comm.mesh import Mesh
from trainer.comm.protocol import Communicator
from trainer.comm.timing import CommClock, timed_mesh
from trainer.config.options import TrainConfig, resolve_dp
from trainer.construction import build_rank_model, build_sharded_model
from trainer.data.batches import BatchPlan, ShardedBatches
from trainer.data.corpus import Corpus
from trainer.data.sources import TokenData, make_batches
from trainer.data.token_batches import TokenBatches
from trainer.errors import TrainerError
from trainer.gpu.compile import compile_blocks
from trainer.gpu.settings import configure_matmul
from trainer.hf.folder import load_rank_slices, rank_slices, read_folder
from trainer.model.family import build_model
from trainer.model.gpt import GPT
from trainer.optim.grad_clip import NormScope
from trainer.optim.main_weights import MainWeights, PlainWeights
from trainer.optim.mixed_precision import DTYPES, MainParams, model_dtype
from trainer.optim.optimizer import LRSchedule, build_optimizer
from trainer.parallel.context.attention import Exchange
from trainer.parallel.context.model import context_parallel, keep_chunks
from trainer.parallel.data.buckets import reduction_schedule
from trainer.parallel.data.split import GradSync, data_parallel
from trainer.parallel.expert.layer import set_aux_scale
from trainer.parallel.pipeline.partition import StageLayout
from trainer.parallel.pipeline.stages import build_stage_model, tied_weight
from trainer.parallel.tensor.parallelize import parallelize
from trainer.parallel.tensor.random import DropoutSeeds, RNGStatesTracker
from trainer.parallel.zero import build_zero
from trainer.parallel.zero.split import build_split_zero3
from trainer.parallel.zero.units import UnitShards
from trainer.placement import dp_axes, leads, place_parameters, placement_of
from trainer.placement.parameters import DP_AXES
from trainer.plan.budget import check_budget
from trainer.training import startup
from trainer.training.body import Accumulation, StepBody
from trainer.training.guard import StepGuard
from trainer.training.pipeline_step import build_pipeline, stage_layout
from trainer.training.resume import Restored, restore, start_anew


@dataclass
class Run:
    """Everything one rank trains with (built by `build_run`)."""

    cfg: TrainConfig
    mesh: Mesh
    """This rank's place on the axes and its groups, each timed on ``clock``."""
    model: GPT
    dp: GradSync
    """The gradient sync: over each parameter's DP replicas (the reduce-scatter under
    ZeRO-1 and 2)."""
    weights: MainWeights
    """What AdamW steps (`trainer.optim.main_weights`)."""
    body: StepBody
    """Forward and backward of a step: accumulation or a pipeline (`trainer.training.body`)."""
    batches: ShardedBatches | TokenBatches
    corpus: Corpus | TokenData
    lr_schedule: LRSchedule
    seeds: DropoutSeeds
    tracker: RNGStatesTracker
    """Random streams of TP regions (attention dropout), reseeded every step."""
    norm_scope: NormScope
    """Which groups the gradient norm is summed over, and what this rank counts in it."""
    guard: StepGuard
    clock: CommClock
    """Communication time of every group (`trainer.comm.timing`)."""
    restored: Restored
    """Where the run starts: the checkpoint's step (0: none), what --resume did and read."""
    device_notes: str
    """What `trainer.gpu` set up for the banner (tf32, compiled blocks)."""

    @property
    def is_writer(self) -> bool:
        """Global rank 0: it logs and reports for the run."""
        return self.mesh.rank() == 0


def mesh_for(cfg: TrainConfig, world: World) -> Mesh:
    """The mesh of ``cfg``'s layout over ``world`` (collective: splits the world)."""
    return Mesh.build(world.comm, resolve_dp(cfg, world.size).parallel.mesh(), world.device)


def build_run(cfg: TrainConfig, mesh: Mesh, corpus: Corpus | TokenData | None = None) -> Run:
    """Model, optimizer, data, DP (and the pipeline) of this rank of ``mesh``, restored from a
    checkpoint on --resume. ``corpus`` is the checked data (read here when not given). Every
    group is timed on the run's clock. The steps run in one order on every rank: several of
    them are collective."""
    if cfg.parallel.overlap is None:  # chosen once, for the banner, the budget and every sync
        cfg = cfg.with_options(
            overlap=reduction_schedule(mesh.group("dp_cp").backend) != "sync")
    clock = CommClock()
    mesh = timed_mesh(mesh, clock)
    device = mesh.device
    corpus = _checked_inputs(cfg, corpus, mesh)
    tracker = RNGStatesTracker(device)
    layout = stage_layout(cfg, mesh.rank("pp")) if cfg.parallel.pp > 1 else None
    check_budget(cfg, bf16=model_dtype(cfg.optimizer.precision, device) is not None,
                 report=mesh.rank() == 0)  # before the model is built (--memory-budget)
    built, hf = None, cfg.checkpoint.init_from_hf  # a checkpoint, if --resume finds one, wins
    if cfg.optimizer.zero == 3 and not cfg.gpt.moe.experts:
        model, built = build_sharded_model(  # straight into shards: no unit ever whole
            cfg.gpt, cfg.seed, device=device, dp=_shard_group(cfg, mesh),
            alone=_tied_names(cfg, layout), layout=layout, tp=mesh.group("tp"),
            tracker=tracker, sequence_parallel=cfg.parallel.sequence_parallel,
            recompute=cfg.parallel.recompute,
            values=(lambda m: rank_slices(m, read_folder(Path(hf)), mesh.rank("tp"),
                                          mesh.size("tp"))) if hf else None)
    else:
        model = _rank_model(cfg, layout, mesh.group("tp"), tracker, device)
        if hf:
            load_rank_slices(model, read_folder(Path(hf)), mesh.rank("tp"), mesh.size("tp"))
    set_aux_scale(model, cfg.parallel.microbatches)
    place_parameters(model, mesh, copies=_copies(cfg, layout))
    optimizer = _optimizer(cfg, model)
    dtype = model_dtype(cfg.optimizer.precision, device)
    dp, weights = _weights(cfg, model, optimizer, dtype, mesh, clock, layout=layout,
                           built=built)
    if cfg.parallel.cp > 1:  # its share of every sequence (trainer.parallel.context); after
        # DP's broadcast of rank 0's buffers, as the rotary rows differ between cp ranks
        model = context_parallel(model, mesh.group("cp"),
                                 cast(Exchange, cfg.parallel.cp_comm))  # one of its choices
    restored = restore(cfg, mesh, weights) if cfg.checkpoint.resume else \
        start_anew(cfg, leader=mesh.rank() == 0)
    notes = [configure_matmul(device, "fp32" if dtype is None else "bf16")]
    if cfg.compile and compile_blocks(model, cfg.micro_batch, world=mesh.group()):
        notes.append("compiled blocks")
    batches = make_batches(corpus, seq_len=cfg.gpt.seq_len, seed=cfg.seed, device=device,
                           plan=BatchPlan(cfg.data.global_batch, cfg.parallel.dp,
                                          cfg.parallel.microbatches),
                           dp_rank=mesh.rank("dp"), reporter=mesh.rank() == 0,
                           keep=keep_chunks(cfg.gpt.seq_len, mesh.group("cp"))
                           if cfg.parallel.cp > 1 else None, documents=cfg.data.document_mask)
    if isinstance(batches, TokenBatches) and restored.samples is not None:
        batches.restore(restored.samples, restored.step + 1)  # continue the sample order
    opt = cfg.optimizer
    lr_schedule = LRSchedule(lr=opt.lr, min_lr=opt.min_lr, warmup_steps=opt.warmup_steps,
                             decay_steps=cfg.decay_end)
    # The loss is averaged over the ranks of the global batch's tokens: dp and cp.
    body: StepBody = build_pipeline(cfg, model, layout, mesh.group("pp"), dp,
                                    mesh.group("dp_cp"), device) if layout is not None else \
        Accumulation(model, dp, mesh.group("dp_cp"))
    return Run(cfg, mesh, model, dp, weights, body, batches, corpus, lr_schedule,
               DropoutSeeds.of(cfg.seed, mesh, pipelined=layout is not None), tracker,
               _norm_scope(weights, mesh), StepGuard(cfg.skip_nonfinite), clock, restored,
               ", ".join(n for n in notes if n))


def _copies(cfg: TrainConfig, layout: StageLayout | None) -> dict[str, str]:
    """The parameters that copy another stage's tensor: the last stage's tied head."""
    copy = cfg.gpt.tied and layout is not None and layout.holds_last and not layout.holds_first
    return {"head.weight": "tok_emb.weight"} if copy else {}


def _norm_scope(weights: MainWeights, mesh: Mesh) -> NormScope:
    """The gradient norm summed over the world, each rank counting the stepped tensors it
    leads (`trainer.placement.leads`): every element of the model once, on any layout."""
    world = mesh.group()
    counted = {id(t) for t in weights.values() if leads(placement_of(t), mesh)}
    return NormScope((world,) if world.size > 1 else (), lambda t: id(t) in counted)


def _checked_inputs(cfg: TrainConfig, corpus: Corpus | TokenData | None, mesh: Mesh
                    ) -> Corpus | TokenData:
    """The mesh fits the layout, and every rank reads the same training data (``corpus``,
    read here when not given)."""
    shape = cfg.parallel.mesh()
    if mesh.shape != shape:
        raise TrainerError("mesh does not match the options", repr(mesh),
                           f"the options ask for {shape}",
                           "Build the mesh from the run's options (`mesh_for`)")
    corpus = startup.training_data(cfg) if corpus is None else corpus
    startup.require_same(mesh.group(), int(corpus.fingerprint[:15], 16), mesh.device,
                         "ranks read different training data", corpus.source,
                         "Give every host the same --data (or the same Python for the "
                         "default corpus)")
    return corpus


def _rank_model(cfg: TrainConfig, layout: StageLayout | None, tp: Communicator,
                tracker: RNGStatesTracker, device: torch.device) -> GPT:
    """This rank's part of the model (its stage under ``layout``, its TP shard over ``tp``)."""
    if not cfg.gpt.moe.experts:  # built on the meta device, only this rank's shard allocated
        return build_rank_model(cfg.gpt, cfg.seed, device=device, layout=layout, tp=tp,
                                tracker=tracker,
                                sequence_parallel=cfg.parallel.sequence_parallel,
                                recompute=cfg.parallel.recompute)
    # Per-rank construction does not cover experts yet (trainer.config.options refuses SP and
    # recompute with them): the model is built whole, then cut and sharded.
    model = (build_stage_model(cfg.gpt, cfg.seed, layout) if layout else
             build_model(cfg.gpt, seed=cfg.seed)).to(device)
    return parallelize(model, tp, tracker=tracker)


def _shard_group(cfg: TrainConfig, mesh: Mesh) -> Communicator:
    """The ranks ZeRO-3 shards a unit over: dp x cp (cp ranks hold the same weights; the dp
    group itself at cp 1), or the hybrid shard group (the mesh's zs; refused with cp)."""
    return mesh.group("zs") if cfg.parallel.zero_shard_size else mesh.group("dp_cp")


def _tied_names(cfg: TrainConfig, layout: StageLayout | None) -> set[str]:
    """The tied embedding this stage holds, a unit of its own under pipelining
    (`trainer.parallel.pipeline.stages.tied_weight`, asked of the names before the model
    has values)."""
    if not cfg.gpt.tied or layout is None:
        return set()
    return {"tok_emb.weight"} if layout.holds_first else \
        {"head.weight"} if layout.holds_last else set()


def _weights(cfg: TrainConfig, model: GPT, optimizer: torch.optim.Optimizer,
             dtype: torch.dtype | None, mesh: Mesh, clock: CommClock, *,
             layout: StageLayout | None, built: UnitShards | None = None
             ) -> tuple[GradSync, MainWeights]:
    """The gradient sync over the mesh's DP groups (each parameter over the axes its copies
    span, `trainer.placement.dp_axes`), and what holds the main weights."""
    par = cfg.parallel
    reduce_dtype = DTYPES[par.grad_reduce_dtype] if par.grad_reduce_dtype != "fp32" else None
    dp_comm = mesh.group("dp_cp")  # cp ranks hold the same weights: ZeRO shards over both
    overlap = bool(par.overlap)  # chosen by `build_run` where not given
    if cfg.optimizer.zero:  # the tied embedding's own bucket: its shards match across stages
        tied = tied_weight(model, layout) if layout else None
        if cfg.optimizer.zero == 3 and cfg.gpt.moe.experts:  # experts shard over edp
            return build_split_zero3(
                model, optimizer, lambda p: dp_axes(placement_of(p)), mesh.group, dtype,
                prefetch=cfg.optimizer.zero_prefetch, blocked=clock.blocked,
                alone=[tied] if tied is not None else [], bucket_size=par.bucket_size,
                overlap=overlap, reduce_dtype=reduce_dtype)
        hybrid: dict[str, Any] = {"built": built}
        if par.zero_shard_size:  # shard over the mesh's zs axis, replicate over zr
            dp_comm = _shard_group(cfg, mesh)
            hybrid.update(replicas=mesh.group("zr"),
                          over=tuple(axis for axis in DP_AXES if axis != "zr"))
        sync, zero = build_zero(model, optimizer, dp_comm, dtype, stage=cfg.optimizer.zero,
                                bucket_size=par.bucket_size, overlap=overlap,
                                reduce_dtype=reduce_dtype, alone=[tied] if tied is not None else [],
                                prefetch=cfg.optimizer.zero_prefetch, blocked=clock.blocked,
                                **hybrid)
        return sync, zero
    dp_options: dict[str, Any] = dict(bucket_size=par.bucket_size, overlap=overlap,
                                      reduce_dtype=reduce_dtype, grads_to_params=dtype is None)
    dp = data_parallel(model, lambda p: dp_axes(placement_of(p)), mesh.group, **dp_options)
    if dtype is None:
        return dp, PlainWeights(dp.params, optimizer)
    # Cast after DP's broadcast from rank 0, so the fp32 main weights are rank 0's too.
    return dp, MainParams.take(model, optimizer, dtype, lambda params: _optimizer(cfg, params))


def _optimizer(cfg: TrainConfig, params: torch.nn.Module | list[torch.nn.Parameter]
               ) -> torch.optim.Optimizer:
    return build_optimizer(params, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
