"""One training run as a rank holds it: model, optimizer, DP, data, schedule, groups.

`build_run` assembles it from the config and the communicators (the same code for every
layout); `trainer.train` steps it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.checkpoint import Checkpoint
from trainer.comm.bootstrap import ParallelGroups
from trainer.comm.protocol import Communicator
from trainer.comm.timing import CommClock, timed_groups
from trainer.config.options import TrainConfig
from trainer.construction import build_rank_model
from trainer.data.batches import BatchPlan, ShardedBatches
from trainer.data.corpus import Corpus
from trainer.data_parallel.grad_sync import DataParallel
from trainer.gpu.compile import compile_blocks
from trainer.gpu.settings import configure_matmul
from trainer.model.gpt import GPT
from trainer.moe.parallel import (
    ExpertDataParallel,
    ExpertGroups,
    apply_expert_parallel,
    checkpoint_writers,
    ep_scope,
)
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
    model: GPT
    optimizer: torch.optim.Optimizer
    dp: DataParallel
    batches: ShardedBatches
    corpus: Corpus
    schedule: Schedule
    dp_rank: int
    is_writer: bool
    start_step: int = 0
    resumed: str = ""
    """What --resume did: the step, skipped checkpoints, changed options (for the banner)."""
    tp_comm: Communicator | None = None
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
    experts: ExpertGroups | None = None
    """The EP and expert-DP groups of an MoE model (`trainer.moe`), else None."""

    @property
    def tp_rank(self) -> int:
        return self.tp_comm.rank if self.tp_comm is not None else 0

    @property
    def ep_rank(self) -> int:
        """Index in the EP block of DP ranks (also on a pipeline stage without MoE layers)."""
        return self.dp_rank % self.cfg.ep

    @property
    def pp_rank(self) -> int:
        return self.pipeline.comm.rank if self.pipeline is not None else 0


def build_run(cfg: TrainConfig, *, rank: int, dp_comm: Communicator,
              device: torch.device, groups: ParallelGroups | None = None,
              world_comm: Communicator | None = None, corpus: Corpus | None = None) -> Run:
    """Model, optimizer, data, DP (and the pipeline) of this rank, restored from a checkpoint on
    --resume. ``groups`` (needed when cfg.tp > 1 or cfg.pp > 1) supplies the TP and PP groups;
    DP runs on ``dp_comm``; ``world_comm`` (needed when cfg.pp > 1, or cfg.ep > 1 with
    cfg.tp > 1) forms the shard writers;
    ``corpus`` is the checked data (read here when not given). Every group is timed on the
    run's clock. The steps run in one order on every rank: several of them are collective."""
    clock = CommClock()
    groups, dp_comm = timed_groups(groups, dp_comm, clock)
    tp_comm = groups.tp if groups is not None else None
    pp_comm = groups.pp if groups is not None else None
    corpus = _checked_inputs(cfg, corpus, device, (dp_comm, tp_comm, pp_comm), world_comm)
    tracker = RNGStatesTracker(device)
    layout = stage_layout(cfg, pp_comm.rank) if cfg.pp > 1 else None
    model = _rank_model(cfg, layout, groups, tracker, device)
    experts = apply_expert_parallel(model, ep=cfg.ep, microbatches=cfg.microbatches, dp=dp_comm,
                                    tp=tp_comm)
    optimizer = build_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay)
    shard = (tp_comm.rank if tp_comm is not None else 0, pp_comm.rank if layout else 0,
             dp_comm.rank % cfg.ep)
    deciders = [c for c in (dp_comm, tp_comm, pp_comm) if c is not None]
    start, resumed, ckpt = restore(cfg, model, optimizer, deciders=deciders, shard=shard,
                                   device=device) if cfg.resume else \
        start_anew(cfg, leader=rank == 0)
    dtype = model_dtype(cfg.precision, device)
    dp, main, zero = _data_parallel(cfg, model, optimizer, dtype, dp_comm, experts, layout=layout,
                                    ckpt=ckpt, shard=shard, deciders=deciders, device=device)
    optimizer = main.optimizer if main is not None else optimizer
    notes = [configure_matmul(device, "fp32" if dtype is None else "bf16")]
    if cfg.compile and compile_blocks(model, cfg.global_batch // (cfg.dp * cfg.microbatches),
                                      rank=rank, groups=deciders):
        notes.append("compiled blocks")
    batches = ShardedBatches(corpus, seq_len=cfg.gpt.seq_len, seed=cfg.seed, device=device,
                             plan=BatchPlan(cfg.global_batch, cfg.dp, cfg.microbatches),
                             dp_rank=dp_comm.rank)
    schedule = Schedule(lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps,
                        decay_steps=cfg.schedule_end)
    scope = tp_scope(tp_comm) if tp_comm is not None else NormScope()
    if experts is not None:
        scope = ep_scope(scope, experts.ep, model)
    pipeline = build_pipeline(cfg, model, layout, pp_comm, dp, device) \
        if layout is not None else None
    if pipeline is not None:
        scope = pipeline.norm_scope(scope)
    writers = _writers(cfg, shard, dp_comm, tp_comm, world_comm, pipelined=layout is not None)
    return Run(cfg, model, optimizer, dp, batches, corpus, schedule, dp_comm.rank,
               is_writer=rank == 0, start_step=start, resumed=resumed, tp_comm=tp_comm,
               tracker=tracker, norm_scope=scope, pipeline=pipeline, writers=writers,
               guard=StepGuard(cfg.skip_nonfinite), clock=clock, main=main, zero=zero,
               device_notes=", ".join(n for n in notes if n), experts=experts)


def _checked_inputs(cfg: TrainConfig, corpus: Corpus | None, device: torch.device,
                    comms: tuple[Communicator, Communicator | None, Communicator | None],
                    world_comm: Communicator | None) -> Corpus:
    """The groups fit the layout, and every rank of every group in ``comms`` (dp, tp, pp) reads
    the same training data (``corpus``, read here when not given)."""
    startup.check_groups(cfg, comms[1], comms[2], world_comm)
    corpus = startup.training_data(cfg) if corpus is None else corpus
    for comm in (c for c in comms if c is not None):
        startup.require_same(comm, int(corpus.fingerprint[:15], 16), device,
                             "ranks read different training data", corpus.source,
                             "Give every host the same --data (or the same Python for the "
                             "default corpus)")
    return corpus


def _rank_model(cfg: TrainConfig, layout: StageLayout | None, groups: ParallelGroups | None,
                tracker: RNGStatesTracker, device: torch.device) -> GPT:
    """This rank's part of the model (its stage under ``layout``, its TP shard under ``groups``)."""
    if not cfg.gpt.moe_experts:  # built on the meta device, only this rank's shard allocated
        return build_rank_model(cfg.gpt, cfg.seed, device=device, layout=layout, groups=groups,
                                tracker=tracker, sequence_parallel=cfg.sequence_parallel,
                                recompute=cfg.recompute)
    # Per-rank construction does not cover experts yet (trainer.config.options refuses SP and
    # recompute with them): the model is built whole, then cut and sharded.
    model = (build_stage_model(cfg.gpt, cfg.seed, layout) if layout else
             GPT(cfg.gpt, seed=cfg.seed)).to(device)
    return parallelize(model, groups, tracker=tracker) if groups is not None else model


def _data_parallel(cfg: TrainConfig, model: GPT, optimizer: torch.optim.Optimizer,
                   dtype: torch.dtype | None, dp_comm: Communicator,
                   experts: ExpertGroups | None, *, layout: StageLayout | None,
                   ckpt: Checkpoint | None,
                   shard: tuple[int, int, int], deciders: list[Communicator],
                   device: torch.device
                   ) -> tuple[DataParallel, MainParams | ZeroOptimizer | None,
                              ZeroOptimizer | None]:
    """DP over ``dp_comm``, and what holds the main weights: (dp, main, the ZeRO optimizer)."""
    reduce_dtype = DTYPES[cfg.grad_reduce_dtype] if cfg.grad_reduce_dtype != "fp32" else None
    if cfg.zero:  # the tied embedding gets a bucket of its own: its shards match across stages
        tied = tied_weight(model, layout) if layout else None
        sync, zero = build_zero(model, optimizer, dp_comm, dtype, bucket_size=cfg.bucket_size,
                                overlap=cfg.overlap, reduce_dtype=reduce_dtype,
                                alone=[tied] if tied is not None else [])
        if ckpt is not None and ckpt.optim is None:
            resume_shards(zero, ckpt, shard[:2], deciders, device)
        return sync, zero, zero
    dp_options: dict[str, Any] = dict(bucket_size=cfg.bucket_size, overlap=cfg.overlap,
                                      reduce_dtype=reduce_dtype, grads_to_params=dtype is None)
    dp = DataParallel(model, dp_comm, **dp_options) if experts is None else \
        ExpertDataParallel.build(model, dp_comm, experts.edp, **dp_options)
    # Cast after DP's broadcast from rank 0, so the fp32 main weights are rank 0's too.
    main = MainParams.take(model, optimizer, dtype, lambda params: build_optimizer(
        params, lr=cfg.lr, weight_decay=cfg.weight_decay)) if dtype is not None else None
    return dp, main, None


def _writers(cfg: TrainConfig, shard: tuple[int, int, int], dp_comm: Communicator,
             tp_comm: Communicator | None, world_comm: Communicator | None, *,
             pipelined: bool) -> Communicator | None:
    """The group that writes a checkpoint together (splits of ``world_comm`` are collective)."""
    writers = tp_comm
    if pipelined:  # every tp x pp rank of one DP replica
        writers = world_comm.split(dp_comm.rank, shard[0] + cfg.tp * shard[1], name="writers")
    if cfg.zero:  # every rank writes its optimizer shard
        writers = world_comm if world_comm is not None else dp_comm
    if cfg.ep > 1:  # on every stage, with or without MoE layers: the split is collective
        writers = checkpoint_writers(world_comm, dp_comm, cfg.ep, shard, tp=cfg.tp, pp=cfg.pp)
    return writers
