"""Train a byte-level GPT, data and tensor parallel over the ranks of the job.

    python -m trainer.train --model tiny --steps 100 --run-dir runs/tiny           # one process
    mpiexec -n 4 python -m trainer.train --model small --global-batch 32 --run-dir runs/s
    mpiexec -n 4 python -m trainer.train --model small --tp 2 --run-dir runs/tp  # dp 2 x tp 2
    dtrain launch --nproc-per-node 2 -- python -m trainer.train --model tiny --run-dir runs/t
    python -m trainer.train --config run.toml --resume        # continue the newest checkpoint

Start-up (`trainer.training.startup`) checks options, world and data on every rank and reports bad
input once. Each step: the step's global batch (from seed and step alone, training split) is
split over the DP ranks and into microbatches; backward runs with bucketed, overlapped gradient
all-reduce (`trainer.parallel.data.grad_sync`); gradients are clipped and AdamW steps; communication
is timed (`trainer.comm.timing`). Every ``--eval-every`` steps the held-out split is evaluated
(`trainer.inference.validation`). A step leaves its loss and gradient norm on the device; each
``--log-every`` interval (and each evaluation or checkpoint step) reads them in one copy
(`trainer.training.readout`). Rank 0 logs, writes a ``metrics.jsonl`` line per step, ``loss.png``
at the end. Every ``--save-every`` steps and at the end each rank saves the slices it is the
writer of (one writer per slice, spread over the ranks that hold it: `trainer.placement`),
staged on the host and written in the background while training goes on (``--async-save``, the
default: `trainer.training.checkpointing`).
``--resume`` continues from the newest committed checkpoint at any layout (bit-exactly at the
saved one; the run dir must be visible to every rank, as with Megatron or DeepSpeed), verified
file by file (`trainer.training.resume` states the rule and ``--resume-fallback``). Dropout is
reseeded from (seed, step, dp rank) every step, so the random stream needs no state across a
resume. Under ``dtrain launch --max-restarts`` a restarted round resumes by itself
(`trainer.training.restart`); SIGTERM stops every rank after the same step with a checkpoint
and exit code 143 (`trainer.stopping.sigterm`). A NaN or Inf loss or gradient norm stops every
rank before the update, and non-finite parameters are never saved (`trainer.training.guard`).
Each log line shows the MFU when the device's peak is known (`trainer.model.flops`,
``--peak-tflops``).

With ``--precision bf16`` (the default on CUDA) the model runs in bf16 and AdamW steps fp32
main weights on the fp32 main gradients of the DP buffer (`trainer.optim.mixed_precision`); the
checkpoints hold the fp32 main weights.

With ``--zero 1`` (`trainer.parallel.zero`) each bucket's gradients are reduce-scattered instead of
all-reduced, AdamW (and under bf16 the fp32 main weights) holds only this DP rank's shard, and
the stepped shards are all-gathered into the parameters; every rank checkpoints its own pieces.
Rank 0 prints the expected bytes per rank at start-up, and ``metrics.jsonl`` records each
step's peak memory (`trainer.parallel.zero.memory`).

With ``--tp N`` the model is split over N adjacent ranks by `trainer.parallel.tensor.parallelize`
(each DP replica is a TP group); DP reduces over the DP group only, the gradient norm is summed over
TP (`trainer.optim.grad_clip`), attention dropout draws from a TP stream seeded per (step, dp
rank, tp rank).

With ``--pp N`` the layers are split into N stages (``--virtual-stages V`` chunks per rank with
``--schedule interleaved``; ``--pp-layers`` overrides the balanced split) and each step runs the
pipeline schedule (`trainer.training.pipeline_step`): the ``--microbatches`` are the pipeline's,
the tied embedding's gradient is summed over the first and last stage, the gradient norm over
TP and PP. Ranks follow Megatron's ``tp-dp-pp`` order. The loss is computed on the last stage
and broadcast over the pipeline, so rank 0 (first stage) logs it like any run. At the end
rank 0 writes the last step's
timeline (``timeline.json`` for Perfetto, ``timeline.png``) and logs the measured bubble.
Dropout seeds also mix in the pp rank (each stage draws its own masks).

    mpiexec -n 8 python -m trainer.train --model tiny --dp 2 --tp 2 --pp 2 --microbatches 4 \
        --schedule interleaved --virtual-stages 2 --n-layer 4 --run-dir runs/3d

With ``--moe-experts E`` the MLPs of every ``--moe-every``-th layer are mixtures of experts,
and ``--ep N`` splits their experts over N DP ranks (`trainer.parallel.expert`): each step's
record holds
the expert load and ``expert_load.png`` is drawn at the end.

    mpiexec -n 4 python -m trainer.train --model tiny --moe-experts 8 --ep 4 --run-dir runs/moe
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from trainer.comm.bootstrap import World
from trainer.comm.progress import record_of
from trainer.config.options import TrainConfig, resolve_dp
from trainer.dashboards.hub import Dashboards, open_sinks
from trainer.data.corpus import Corpus, skipped_warning
from trainer.data.sources import TokenData, keep_tokenizer
from trainer.errors import TrainerError
from trainer.gpu.settings import keep_freed_memory
from trainer.inference.validation import Validation
from trainer.model.config import FAMILY_NAMES
from trainer.model.flops import flops_per_token, mfu, peak_tflops
from trainer.parallel.zero import memory
from trainer.parallel.zero.memory import PeakMemory
from trainer.placement import dp_axes, placement_of
from trainer.stopping import sigterm
from trainer.stopping.time_limit import TimeLimit
from trainer.training import readout, restart, startup
from trainer.training.budget import BudgetMeter
from trainer.training.checkpointing import Checkpoints
from trainer.training.expert_load import write_load_plot
from trainer.training.metrics import MetricsLog
from trainer.training.pipeline_step import (
    describe_pipeline,
)
from trainer.training.plan_check import PlanCheck
from trainer.training.readout import PendingStep
from trainer.training.run import Run, build_run, mesh_for
from trainer.training.step import run_step

__all__ = ["TrainResult", "main", "train"]


@dataclass
class TrainResult:
    """What a run did (on every rank): the losses of the steps it ran, and where it ended."""

    start_step: int
    final_step: int
    losses: list[float] = field(default_factory=list)
    checkpoint: Path | None = None
    stopped_at: int | None = None
    """The step every rank stopped after on SIGTERM (`trainer.stopping.sigterm`), else None."""


def train(cfg: TrainConfig, world: World, corpus: Corpus | TokenData | None = None
          ) -> TrainResult:
    """Run training on this rank of ``world`` (on ``corpus``, the checked data, if given)."""
    cfg = resolve_dp(cfg, world.size)
    keep_freed_memory(world.device)  # a process setting, so here and not in build_run
    run = build_run(cfg, mesh_for(cfg, world), corpus)
    peak = peak_tflops(world.device, cfg.peak_tflops)
    log = MetricsLog(Path(cfg.run_dir), enabled=run.is_writer, total_steps=cfg.steps,
                     start_step=run.restored.step, log_every=cfg.logging.log_every,
                     mfu=(lambda rate: mfu(rate, cfg.gpt, peak, world.size)) if peak else None)
    log.info(_banner(run, world.size))
    log.info(restart.announcement(restart.of_environ(os.environ), run.restored.step))
    log.info(run.restored.warning)
    log.info(startup.binary_warning(run.corpus))
    log.info(skipped_warning(run.corpus))
    log.info(memory_line(run))
    plan = PlanCheck(run, world)  # the planner's line; its memory checked after the first step
    log.info(plan.line)
    if cfg.checkpoint.init_from_hf and run.is_writer:  # its tokenizer: the run's ids
        from trainer.hf import source

        source.keep(Path(cfg.checkpoint.init_from_hf), Path(cfg.run_dir))
    if isinstance(run.corpus, TokenData) and run.is_writer:  # generate and export decode with it
        keep_tokenizer(run.corpus, Path(cfg.run_dir))
    peak_mem = PeakMemory(world.device)
    dash = Dashboards(
        open_sinks(Path(cfg.run_dir), tensorboard=cfg.logging.tensorboard,
                   wandb=cfg.logging.wandb, config=cfg.to_dict(), enabled=run.is_writer),
        flops_per_token=flops_per_token(cfg.gpt), devices=world.size, peak_tflops=peak,
        skipped=lambda: len(run.guard.skipped))
    validation = Validation.of(run.corpus, run.batches, run.model, run.body,
                               run.mesh.group("dp_cp"), run.mesh.group("pp")) \
        if cfg.logging.eval_every else None
    result = TrainResult(run.restored.step, run.restored.step)
    progress = record_of(world.comm)  # read by the launcher: hangs, live view, stragglers
    pending: list[PendingStep] = []
    time_limit = TimeLimit(cfg.time_limit, world.comm, cfg.logging.log_every, world.device)
    stop = sigterm.install(world.mpi_comm, world.size, world.rank)
    saves = Checkpoints(run, world)
    log.info(saves.describe())
    budget = BudgetMeter.of(run)  # --memory-budget held to the accounting after each step
    val = None
    try:
        for step in range(run.restored.step + 1, cfg.last_step + 1):
            with plan.metered():
                pending.append(run_step(run, step))
            log.info(plan.after_first_step())
            if budget is not None:
                budget.after_step(step)
            done = pending[-1]
            pending[-1] = replace(done, record=replace(done.record,
                                                       peak_mem_bytes=peak_mem.take()))
            if progress is not None:  # host timings: known without reading the device
                progress.step(step, done.record.compute_s)
            result.final_step = step
            saves.poll()
            last = step == cfg.last_step or time_limit.reached(step) or stop.after(step)
            evaluate = validation is not None and (step % cfg.logging.eval_every == 0 or last)
            every = cfg.checkpoint.save_every
            save = every > 0 and step % every == 0 and not last
            if evaluate or save or step % cfg.logging.log_every == 0 or last:
                val = validation.loss(cfg.data.eval_batches) \
                    if evaluate and validation is not None else None
                if last:  # logged after the last save, with what it measured
                    break
                _log_steps(log, dash, result, pending, val, saves.take_reports())
            if save:
                saves.save(step)
        result.checkpoint = saves.last(result.final_step)
        _log_steps(log, dash, result, pending, val, saves.take_reports())
        if run.mesh.is_first("tp", "dp_cp"):  # one pipeline's ranks gather its timeline
            log.info(run.body.report(Path(cfg.run_dir), write=run.is_writer))
    finally:
        error = sys.exc_info()[1]
        # An error every rank raised together (a NaN stop) still finishes the save in flight.
        saves.close(clean=error is None or (isinstance(error, TrainerError) and error.agreed))
        stop.close(clean=error is None)
        result.stopped_at = stop.stopped_at
        _log_steps(log, dash, result, pending)  # the good steps before an error are kept
        dash.close()
        log.close(plot_title=f"{cfg.model.preset} {FAMILY_NAMES[cfg.gpt.arch]}, "
                             f"{cfg.parallel.describe()}, "
                             f"global batch {cfg.data.global_batch}")
    if run.is_writer:
        log.info(write_load_plot(Path(cfg.run_dir), title=f"expert load, {cfg.gpt.moe.experts} "
                                 f"experts, top-{cfg.gpt.moe.topk}, {cfg.parallel.describe()}"))
    return result


def _log_steps(log: MetricsLog, dash: Dashboards, result: TrainResult,
               pending: list[PendingStep], val_loss: float | None = None,
               saves: list[dict[str, Any]] | None = None) -> None:
    """Read the pending steps (one host transfer), log them and empty ``pending``; the last
    one gets ``val_loss`` and what the ``saves`` finished since the last log measured."""
    records = readout.read(pending)
    pending.clear()
    if records:
        records[-1] = replace(records[-1], val_loss=val_loss, checkpoint=saves or None)
    for rec in records:
        log.record(rec)
        dash.record(rec)
        result.losses.append(rec.loss)


def memory_line(run: Run) -> str:
    """Rank 0's expected parameter, gradient and optimizer bytes
    (`trainer.parallel.zero.memory`): its experts sharded over their expert-data-parallel
    group, the rest over dp (`trainer.config.sections.ParallelSection.zero_over`)."""
    par = run.cfg.parallel
    where = "rank 0" + (", its TP x PP shard" if par.tp * par.pp > 1 else "")
    # The experts are the parameters whose copies span fewer DP axes than the rest
    # (`trainer.placement.dp_axes`; one kind of them: `trainer.parallel.zero.split`).
    spans = [len(dp_axes(placement_of(p))) for p in run.dp.params]
    experts = sum(p.numel() for p, n in zip(run.dp.params, spans, strict=True)
                  if n < max(spans, default=0))
    return memory.describe(sum(p.numel() for p in run.dp.params), zero=run.cfg.optimizer.zero,
                           bf16=_bf16(run), dp=par.zero_over, where=where, experts=experts,
                           experts_over=par.expert_zero_over)


def _bf16(run: Run) -> bool:
    return next(run.model.parameters()).dtype == torch.bfloat16


def _banner(run: Run, world_size: int) -> str:
    cfg, par = run.cfg, run.cfg.parallel
    resumed = f", {run.restored.said}" if run.restored.said else ""
    per_rank = " per TP rank" if par.tp > 1 else ""
    per_rank += " of pipeline rank 0" if par.pp > 1 else ""
    pipeline = f" ({describe_pipeline(cfg)})" if par.pp > 1 else ""
    return (f"dtrain: {cfg.model.preset} {FAMILY_NAMES[cfg.gpt.arch]}, "
            f"{run.model.num_params():,} parameters{per_rank} | "
            f"world {world_size} = {cfg.parallel.describe(' x ')}{pipeline} | "
            f"{'bf16, fp32 main weights' if _bf16(run) else 'fp32'}"
            f"{f', ZeRO-{cfg.optimizer.zero}' if cfg.optimizer.zero else ''}"
            f"{', ' + run.device_notes if run.device_notes else ''} | {len(run.dp.buckets)} "
            f"grad bucket(s), overlap {'on' if par.overlap else 'off'} | global batch "
            f"{cfg.data.global_batch} x {cfg.gpt.seq_len} {run.corpus.unit}, {par.microbatches} "
            "microbatch(es) | "
            f"data {run.corpus.source} ({len(run.corpus):,} {run.corpus.unit}, "
            f"{run.corpus.fingerprint})"
            f"{resumed}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: exit 0 on success; on bad input (options, world, data) 2 on every rank,
    printed once (`trainer.training.startup`); on an error in training 2, all ranks aborted."""
    world = None
    try:
        ready = startup.start(argv)
        if isinstance(ready, int):
            return ready
        world, cfg, corpus = ready
        active = restart.active_world(world, cfg)  # None: a rank a smaller layout left out
        if active is None:
            return 0
        result = train(cfg, active, corpus)
        if result.stopped_at is not None:
            if active.rank == 0:
                print(f"dtrain: SIGTERM: every rank stopped after step {result.stopped_at}, "
                      f"checkpoint {result.checkpoint}; exiting {sigterm.EXIT_CODE}",
                      file=sys.stderr, flush=True)
            return sigterm.EXIT_CODE
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
