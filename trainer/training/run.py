"""One training run as a rank holds it: model, optimizer, DP, data, schedule, groups.

`build_run` assembles it from the config and the communicators (the same code for every
layout); `trainer.train` steps it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.checkpoint import Checkpoint
from trainer.comm.bootstrap import World
from trainer.comm.mesh import Mesh
from trainer.comm.protocol import Communicator
from trainer.comm.timing import CommClock, timed_mesh
from trainer.config.options import TrainConfig, mesh_shape, resolve_dp
from trainer.construction import build_rank_model
from trainer.data.batches import BatchPlan, ShardedBatches
from trainer.data.corpus import Corpus
from trainer.data_parallel.grad_sync import DataParallel
from trainer.errors import TrainerError
from trainer.gpu.compile import compile_blocks
from trainer.gpu.settings import configure_matmul
from trainer.model.gpt import GPT
from trainer.moe.parallel import ExpertDataParallel, apply_expert_parallel, ep_scope
from trainer.optim.grad_clip import NormScope, tp_scope
from trainer.optim.mixed_precision import DTYPES, MainParams, model_dtype
from trainer.optim.optimizer import Schedule, build_optimizer
from trainer.pipeline.partition import StageLayout
from trainer.pipeline.stages import build_stage_model, tied_weight
from trainer.tensor_parallel.parallelize import parallelize
from trainer.tensor_parallel.random import RNGStatesTracker
from trainer.training import startup
from trainer.training.guard import StepGuard
from trainer.training.pipeline_step import (
    Pipeline,
    build_pipeline,
    stage_layout,
)
from trainer.training.resume import restore, start_anew
from trainer.zero import ZeroOptimizer, build_zero, resume_shards


@dataclass
class Run:
    """Everything one rank trains with (built by `build_run`)."""

    cfg: TrainConfig
    mesh: Mesh
    """This rank's place on the axes and its groups, each timed on ``clock``."""
    model: GPT
    optimizer: torch.optim.Optimizer
    dp: DataParallel
    batches: ShardedBatches
    corpus: Corpus
    schedule: Schedule
    is_writer: bool
    start_step: int = 0
    resumed: str = ""
    """What --resume did: the step, skipped checkpoints, changed options (for the banner)."""
    tracker: RNGStatesTracker = field(default_factory=RNGStatesTracker)
    """Random streams of TP regions (attention dropout), reseeded every step."""
    norm_scope: NormScope = field(default_factory=NormScope)
    pipeline: Pipeline | None = None
    """The pipeline of this rank (``--pp > 1``), else None."""
    writers: Communicator | None = None
    """The ranks that write one checkpoint shard each: the tp x pp ranks of this DP replica."""
    guard: StepGuard = field(default_factory=StepGuard)
    clock: CommClock = field(default_factory=CommClock)
    """Communication time of the DP, TP and PP groups (`trainer.comm.timing`)."""
    main: MainParams | ZeroOptimizer | None = None
    """The fp32 main parameters under ``--precision bf16`` (`trainer.optim.mixed_precision`), or
    under ``--zero 1`` the sharded optimizer, which has the same interface."""
    zero: ZeroOptimizer | None = None
    """The ZeRO-1 optimizer (``--zero 1``, `trainer.zero`), else None."""
    device_notes: str = ""
    """What `trainer.gpu` set up for the banner (tf32, compiled blocks)."""


def mesh_for(cfg: TrainConfig, world: World) -> Mesh:
    """The mesh of ``cfg``'s layout over ``world`` (collective: splits the world)."""
    return Mesh.build(world.comm, mesh_shape(resolve_dp(cfg, world.size)), world.device)


def build_run(cfg: TrainConfig, mesh: Mesh, corpus: Corpus | None = None) -> Run:
    """Model, optimizer, data, DP (and the pipeline) of this rank of ``mesh``, restored from a
    checkpoint on --resume. ``corpus`` is the checked data (read here when not given). Every
    group is timed on the run's clock. The steps run in one order on every rank: several of
    them are collective."""
    clock = CommClock()
    mesh = timed_mesh(mesh, clock)
    device = mesh.device
    corpus = _checked_inputs(cfg, corpus, mesh)
    tracker = RNGStatesTracker(device)
    layout = stage_layout(cfg, mesh.rank("pp")) if cfg.parallel.pp > 1 else None
    model = _rank_model(cfg, layout, mesh.group("tp"), tracker, device)
    experts = apply_expert_parallel(model, mesh, microbatches=cfg.parallel.microbatches)
    optimizer = _optimizer(cfg, model)
    shard = (mesh.rank("tp"), mesh.rank("pp"), mesh.rank("ep"))
    deciders = [mesh.group("dp"), mesh.group("tp"), mesh.group("pp")]
    start, resumed, ckpt = restore(cfg, model, optimizer, deciders=deciders, shard=shard,
                                   device=device) if cfg.checkpoint.resume else \
        start_anew(cfg, leader=mesh.rank() == 0)
    dtype = model_dtype(cfg.optimizer.precision, device)
    dp, main, zero = _data_parallel(cfg, model, optimizer, dtype, mesh, experts, layout=layout,
                                    ckpt=ckpt, shard=shard)
    optimizer = main.optimizer if main is not None else optimizer
    notes = [configure_matmul(device, "fp32" if dtype is None else "bf16")]
    if cfg.compile and compile_blocks(model, cfg.micro_batch,
                                      world=mesh.group()):
        notes.append("compiled blocks")
    batches = ShardedBatches(corpus, seq_len=cfg.gpt.seq_len, seed=cfg.seed, device=device,
                             plan=BatchPlan(cfg.data.global_batch, cfg.parallel.dp,
                                            cfg.parallel.microbatches),
                             dp_rank=mesh.rank("dp"))
    opt = cfg.optimizer
    schedule = Schedule(lr=opt.lr, min_lr=opt.min_lr, warmup_steps=opt.warmup_steps,
                        decay_steps=cfg.decay_end)
    scope = tp_scope(mesh.group("tp"))
    if experts:
        scope = ep_scope(scope, mesh.group("ep"), model)
    pipeline = build_pipeline(cfg, model, layout, mesh.group("pp"), dp, device) \
        if layout is not None else None
    if pipeline is not None:
        scope = pipeline.norm_scope(scope)
    writers = mesh.group() if cfg.optimizer.zero else mesh.group().split(
        mesh.rank("edp"), mesh.rank("tp", "ep", "pp"), name="writers")
    return Run(cfg, mesh, model, optimizer, dp, batches, corpus, schedule,
               is_writer=mesh.rank() == 0, start_step=start, resumed=resumed,
               tracker=tracker, norm_scope=scope, pipeline=pipeline, writers=writers,
               guard=StepGuard(cfg.skip_nonfinite), clock=clock, main=main, zero=zero,
               device_notes=", ".join(n for n in notes if n))


def _checked_inputs(cfg: TrainConfig, corpus: Corpus | None, mesh: Mesh) -> Corpus:
    """The mesh fits the layout, and every rank reads the same training data (``corpus``,
    read here when not given)."""
    shape = mesh_shape(cfg)
    if mesh.shape != shape:
        raise TrainerError("mesh does not match the options", repr(mesh),
                           f"the options ask for {shape}",
                           "Build the mesh from the run's options (`mesh_shape`)")
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
             GPT(cfg.gpt, seed=cfg.seed)).to(device)
    return parallelize(model, tp, tracker=tracker)


def _data_parallel(cfg: TrainConfig, model: GPT, optimizer: torch.optim.Optimizer,
                   dtype: torch.dtype | None, mesh: Mesh, experts: bool, *,
                   layout: StageLayout | None, ckpt: Checkpoint | None,
                   shard: tuple[int, int, int]
                   ) -> tuple[DataParallel, MainParams | ZeroOptimizer | None,
                              ZeroOptimizer | None]:
    """DP over the mesh's DP group, and what holds the main weights: (dp, main, the ZeRO
    optimizer)."""
    par = cfg.parallel
    reduce_dtype = DTYPES[par.grad_reduce_dtype] if par.grad_reduce_dtype != "fp32" else None
    dp_comm = mesh.group("dp")
    if cfg.optimizer.zero:  # the tied embedding's own bucket: its shards match across stages
        tied = tied_weight(model, layout) if layout else None
        sync, zero = build_zero(model, optimizer, dp_comm, dtype, bucket_size=par.bucket_size,
                                overlap=par.overlap, reduce_dtype=reduce_dtype,
                                alone=[tied] if tied is not None else [])
        if ckpt is not None and ckpt.optim is None:
            resume_shards(zero, ckpt, shard[:2], [mesh.group()], mesh.device)
        return sync, zero, zero
    dp_options: dict[str, Any] = dict(bucket_size=par.bucket_size, overlap=par.overlap,
                                      reduce_dtype=reduce_dtype, grads_to_params=dtype is None)
    dp = ExpertDataParallel.build(model, dp_comm, mesh.group("edp"), **dp_options) \
        if experts else DataParallel(model, dp_comm, **dp_options)
    # Cast after DP's broadcast from rank 0, so the fp32 main weights are rank 0's too.
    main = MainParams.take(model, optimizer, dtype, lambda params: _optimizer(cfg, params)) \
        if dtype is not None else None
    return dp, main, None


def _optimizer(cfg: TrainConfig, params: torch.nn.Module | list[torch.nn.Parameter]
               ) -> torch.optim.Optimizer:
    return build_optimizer(params, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
