"""Train a byte-level GPT, data and tensor parallel over the ranks of the job.

    python -m trainer.train --model tiny --steps 100 --run-dir runs/tiny           # one process
    mpiexec -n 4 python -m trainer.train --model small --global-batch 32 --run-dir runs/s
    mpiexec -n 4 python -m trainer.train --model small --tp 2 --run-dir runs/tp  # dp 2 x tp 2
    dtrain launch --nproc-per-node 2 -- python -m trainer.train --model tiny --run-dir runs/t
    python -m trainer.train --config run.toml --resume        # continue the newest checkpoint

Start-up (`trainer.startup`) checks options, world and data on every rank and reports bad
input once. Each step: the step's global batch (from seed and step alone, training split) is
split over the DP ranks and into microbatches; backward runs with bucketed, overlapped gradient
all-reduce (`trainer.data_parallel`); gradients are clipped and AdamW steps; communication is
timed (`trainer.comm.timing`). Every ``--eval-every`` steps the held-out split is evaluated
(`trainer.inference.validation`). Rank 0 logs, writes ``metrics.jsonl`` every step, ``loss.png``
at the end, and checkpoints every ``--save-every`` steps and at the end. ``--resume`` continues
bit-exactly from the newest committed checkpoint (the run dir must be visible to every rank, as
with Megatron or DeepSpeed), verified file by file (`trainer.resume` states the rule and
``--resume-fallback``). Dropout is reseeded from (seed, step, dp rank) every step, so the random
stream needs no state across a resume. A NaN or Inf loss or gradient norm stops every rank
before the update, and non-finite parameters are never saved (`trainer.guard`). Each log line
shows the MFU when the device's peak is known (`trainer.flops`, ``--peak-tflops``).

With ``--precision bf16`` (the default on CUDA) the model runs in bf16 and AdamW steps fp32
main weights on the fp32 main gradients of the DP buffer (`trainer.mixed_precision`); the
checkpoints hold the fp32 main weights.

With ``--tp N`` the model is split over N adjacent ranks by `trainer.parallelize` (each DP
replica is a TP group); DP reduces over the DP group only, the gradient norm is summed over TP
(`trainer.grad_clip`), attention dropout draws from a TP stream seeded per (step, dp rank,
tp rank), and each TP rank of DP replica 0 writes its own checkpoint shard.

With ``--pp N`` the layers are split into N stages (``--virtual-stages V`` chunks per rank with
``--schedule interleaved``; ``--pp-layers`` overrides the balanced split) and each step runs the
pipeline schedule (`trainer.pipeline.train_step`): the ``--microbatches`` are the pipeline's,
the tied embedding's gradient is summed over the first and last stage, the gradient norm over
TP and PP. Ranks follow Megatron's ``tp-dp-pp`` order. The loss is computed on the last stage
and broadcast over the pipeline, so rank 0 (first stage) logs it like any run. Every (tp, pp)
rank of DP replica 0 writes its own shard, and at the end rank 0 writes the last step's
timeline (``timeline.json`` for Perfetto, ``timeline.png``) and logs the measured bubble.
Dropout seeds also mix in the pp rank (each stage draws its own masks).

    mpiexec -n 8 python -m trainer.train --model tiny --dp 2 --tp 2 --pp 2 --microbatches 4 \
        --schedule interleaved --virtual-stages 2 --n-layer 4 --run-dir runs/3d

With ``--moe-experts E`` the MLPs of every ``--moe-every``-th layer are mixtures of experts,
and ``--ep N`` splits their experts over N DP ranks (`trainer.moe`): each step's record holds
the expert load, ``expert_load.png`` is drawn at the end, and the first N DP replicas write one
checkpoint shard each.

    mpiexec -n 4 python -m trainer.train --model tiny --moe-experts 8 --ep 4 --run-dir runs/moe
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from trainer import checkpoint, startup
from trainer.comm.bootstrap import World, build_groups
from trainer.comm.protocol import ReduceOp
from trainer.comm.topology import ParallelDims
from trainer.config import TrainConfig, resolve_dp
from trainer.data import Corpus, step_seed
from trainer.errors import TrainerError
from trainer.flops import mfu, peak_tflops
from trainer.grad_clip import clip_grad_norm
from trainer.guard import check_parameters
from trainer.inference.validation import Validation
from trainer.metrics import MetricsLog, StepRecord
from trainer.moe.load import step_load, write_load_plot
from trainer.optim import set_lr
from trainer.pipeline.train_step import (
    describe_pipeline,
    write_timeline,
)
from trainer.resume import meta_of
from trainer.run import Run, build_run
from trainer.tensor_parallel.random import TP_RNG

_DROPOUT_STREAM = 1
_TP_DROPOUT_STREAM = 2


@dataclass
class TrainResult:
    """What a run did (on every rank): the losses of the steps it ran, and where it ended."""

    start_step: int
    final_step: int
    losses: list[float] = field(default_factory=list)
    checkpoint: Path | None = None


def train_step(run: Run, step: int) -> StepRecord:
    """One optimizer step (all microbatches); returns rank 0's view of it."""
    run.clock.take()  # what ran between steps (evaluation, checkpoints) is not the step's
    start = time.perf_counter()
    # The pp rank joins the seeds only under PP, so runs without it keep their random streams.
    stage = (run.pp_rank,) if run.pipeline is not None else ()
    torch.manual_seed(step_seed(run.cfg.seed, step, _DROPOUT_STREAM, run.dp_rank, *stage))
    run.tracker.seed(TP_RNG, step_seed(run.cfg.seed, step, _TP_DROPOUT_STREAM, run.dp_rank,
                                       run.tp_rank, *stage))
    lr = run.schedule.lr_at(step)
    set_lr(run.optimizer, lr)
    run.dp.zero_grad()
    micro = run.batches.microbatches(step)
    if run.pipeline is not None:
        loss_sum = run.pipeline.forward_backward(micro)
    else:
        loss_sum = _accumulate(run, micro)
    with run.clock.blocked():
        run.dp.finish_grad_sync()
    if run.pipeline is not None:
        run.pipeline.sync_tied_grads()
    params, scope = (run.main.grads(), run.main.scope(run.norm_scope)) if run.main else (
        run.dp.params, run.norm_scope)
    grad_norm = clip_grad_norm(params, run.cfg.grad_clip, scope)
    if run.pipeline is not None:
        loss = run.pipeline.reduce_loss(loss_sum, run.dp.comm)
    else:
        run.dp.comm.all_reduce(loss_sum, ReduceOp.AVG)  # the logged loss is the global batch's
        loss = float(loss_sum)
    if run.guard.admit(step, loss, grad_norm, report=run.is_writer):  # every rank alike
        run.optimizer.step()
        if run.main is not None:
            run.main.publish()
    load = step_load(run.model, run.dp.comm)
    step_s = time.perf_counter() - start
    exposed, total = run.clock.take()
    return StepRecord(step=step, loss=loss, lr=lr, grad_norm=grad_norm,
                      tokens=run.cfg.global_batch * run.cfg.gpt.seq_len, step_s=step_s,
                      compute_s=step_s - exposed, comm_exposed_s=exposed, comm_total_s=total,
                      moe=load)


def _accumulate(run: Run, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Forward and backward of every microbatch, DP-synchronised on the last one only."""
    loss_sum = torch.zeros((), device=run.dp.buffer.device)
    for i, (x, y) in enumerate(micro):
        last = i == len(micro) - 1
        with nullcontext() if last else run.dp.no_sync():
            # Mean over the step's tokens = mean over microbatches of microbatch means.
            loss = run.model.loss(x, y) / len(micro)
            loss.backward()
        loss_sum += loss.detach()
    return loss_sum


def save_checkpoint(run: Run, step: int) -> Path | None:
    """DP replica 0 writes (with --ep, the first ep replicas: each holds other experts): its
    tp x pp (x ep) ranks one shard each, together; others return None.
    Every rank first checks (collectively) that no parameter is NaN or infinite."""
    pp_comm = run.pipeline.comm if run.pipeline is not None else None
    groups = [c for c in (run.dp.comm, run.tp_comm, pp_comm) if c is not None]
    main = run.main
    check_parameters(main.main if main else run.model.parameters(), step, groups,
                     report=run.is_writer)
    if run.dp_rank >= run.cfg.ep:  # the first EP block of DP ranks holds every expert
        return None
    meta = meta_of(run.cfg, step, source=run.corpus.source, fingerprint=run.corpus.fingerprint)
    return checkpoint.save(Path(run.cfg.run_dir) / "checkpoints", step,
                           model=main.state_dict() if main else run.model.state_dict(),
                           optim=run.optimizer.state_dict(),
                           meta=meta, keep=run.cfg.keep, writers=run.writers,
                           shard=(run.tp_rank, run.pp_rank, run.ep_rank))


def train(cfg: TrainConfig, world: World, corpus: Corpus | None = None) -> TrainResult:
    """Run training on this rank of ``world`` (on ``corpus``, the checked data, if given)."""
    cfg = resolve_dp(cfg, world.size)
    groups = build_groups(world, ParallelDims(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp))
    run = build_run(cfg, rank=world.rank, dp_comm=groups.dp, device=world.device,
                    groups=groups, world_comm=world.comm, corpus=corpus)
    peak = peak_tflops(world.device, cfg.peak_tflops)
    log = MetricsLog(Path(cfg.run_dir), enabled=run.is_writer, total_steps=cfg.steps,
                     start_step=run.start_step, log_every=cfg.log_every,
                     mfu=(lambda rate: mfu(rate, cfg.gpt, peak, world.size)) if peak else None)
    log.info(_banner(run, world.size))
    log.info(startup.binary_warning(run.corpus))
    pipe = run.pipeline
    validation = Validation.of(run.corpus, run.batches, run.model, run.dp.comm,
                               pipe and pipe.comm, pipe and pipe.layout) if cfg.eval_every else None
    result = TrainResult(run.start_step, run.start_step)
    try:
        for step in range(run.start_step + 1, cfg.last_step + 1):
            rec = train_step(run, step)
            if validation and (step % cfg.eval_every == 0 or step == cfg.last_step):
                rec = replace(rec, val_loss=validation.loss(cfg.eval_batches))
            log.record(rec)
            result.losses.append(rec.loss)
            result.final_step = step
            if cfg.save_every and step % cfg.save_every == 0 and step != cfg.last_step:
                save_checkpoint(run, step)
        result.checkpoint = save_checkpoint(run, result.final_step)
        if run.pipeline is not None and groups.coords.tp == 0 and groups.coords.dp == 0:
            log.info(write_timeline(run.pipeline, Path(cfg.run_dir), write=run.is_writer))
    finally:
        log.close(plot_title=f"{cfg.model} GPT, dp={cfg.dp}, tp={cfg.tp}, pp={cfg.pp}, "
                             f"global batch {cfg.global_batch}")
    if run.is_writer:
        write_load_plot(Path(cfg.run_dir), title=f"expert load, {cfg.gpt.moe_experts} experts, "
                        f"top-{cfg.gpt.moe_topk}, ep={cfg.ep}")
    return result


def _banner(run: Run, world_size: int) -> str:
    cfg = run.cfg
    resumed = f", {run.resumed}" if run.resumed else ""
    per_rank = " per TP rank" if cfg.tp > 1 else ""
    per_rank += " of pipeline rank 0" if cfg.pp > 1 else ""
    pipeline = f" ({describe_pipeline(cfg)})" if cfg.pp > 1 else ""
    return (f"dtrain: {cfg.model} GPT, {run.model.num_params():,} parameters{per_rank} | "
            f"world {world_size}"
            f" = dp {cfg.dp} x tp {cfg.tp} x pp {cfg.pp}{pipeline} | "
            f"{'bf16, fp32 main weights' if run.main else 'fp32'} | {len(run.dp.buckets)} "
            f"grad bucket(s), overlap {'on' if cfg.overlap else 'off'} | global batch "
            f"{cfg.global_batch} x {cfg.gpt.seq_len} bytes, {cfg.microbatches} microbatch(es) | "
            f"data {run.corpus.source} ({len(run.corpus):,} bytes, {run.corpus.fingerprint})"
            f"{resumed}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: exit 0 on success; on bad input (options, world, data) 2 on every rank,
    printed once (`trainer.startup`); on an error in training 2, all ranks aborted."""
    world = None
    try:
        ready = startup.start(argv)
        if isinstance(ready, int):
            return ready
        world, cfg, corpus = ready
        train(cfg, world, corpus)
        return 0
    except TrainerError as exc:
        return startup.fail_alone(world, f"error: {exc}", 2, exc)
    except KeyboardInterrupt:
        return startup.fail_alone(world, "interrupted", 130)
    except Exception as exc:  # noqa: BLE001 - report, then abort the other ranks
        import traceback

        traceback.print_exc()
        return startup.fail_alone(world, f"error: unexpected {type(exc).__name__}: {exc}", 1)


if __name__ == "__main__":
    sys.exit(main())
