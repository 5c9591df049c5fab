"""The body of a pipeline-parallel step (`trainer.training.body.StepBody`), between the
schedule and the optimizer.

`trainer.training.step` owns the step (learning rate, clipping, optimizer, logging); with
``--pp > 1`` the run's body is a `Pipeline`:

1. `Pipeline.forward_backward`: this rank's action list of the chosen schedule runs on its
   `GPTStage` over the PP communicator (`trainer.parallel.pipeline.runtime.run_schedule`). DP
   gradient
   buckets are all-reduced once per step, each launched right after the last backward of its
   parameters (the stage's ``grad_sync`` hook) and finished by ``DataParallel.finish_grad_sync``
   after the schedule, Megatron's ``finalize_model_grads`` order.
2. `Pipeline.sum_shared_grads`: the tied embedding's gradient is summed over the embedding
   group (the first and the last stage of this pipeline) so both copies get the serial
   gradient (the main weights know where that gradient is: `MainWeights.sum_grad`).
3. `Pipeline.reduce_loss`: the loss lives on the last stage. It is averaged over DP there and
   broadcast over the pipeline, so *every* rank returns the step's loss and global rank 0 (the
   first stage) logs it like any other run.
4. `Pipeline.eval_loss`: the validation forward, stage to stage; `Pipeline.report`: the
   timeline at the end of a run.

The embedding group is split from the PP communicator rather than the world: it is its first
and last rank, so only the pipeline's own ranks need to take part in the split.

P2P waits: MPI's blocking wait busy-polls. On a host with more ranks than cores (the tests run
8 ranks on 2 cores) a rank waiting for its neighbour would take the core the neighbour needs
to finish, so there the runtime polls with short sleeps instead (`p2p_wait`).

`write_timeline` gathers the last step's timeline of one pipeline and writes ``timeline.json``
(Chrome trace / Perfetto) and ``timeline.png`` (Gantt chart), and reports the measured bubble.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trainer.comm.protocol import Communicator, Handle, ReduceOp, wait_all
from trainer.config.options import TrainConfig
from trainer.model.gpt import GPT
from trainer.model.precision import at_least_fp32
from trainer.optim.main_weights import MainWeights
from trainer.parallel.data.split import GradSync
from trainer.parallel.pipeline.actions import Action
from trainer.parallel.pipeline.check import check_schedule
from trainer.parallel.pipeline.partition import StageLayout, describe
from trainer.parallel.pipeline.runtime import P2PSpec, StepResult, agree_on_spec, run_schedule
from trainer.parallel.pipeline.schedule import build
from trainer.parallel.pipeline.stages import Batch, GPTStage, tied_weight
from trainer.parallel.pipeline.timeline import (
    bubble,
    gather,
    theory,
    write_chrome_trace,
    write_gantt,
)
from trainer.training.metrics import draw

TIMELINE_JSON, TIMELINE_PNG = "timeline.json", "timeline.png"


def stage_layout(cfg: TrainConfig, pp_rank: int) -> StageLayout:
    """This pipeline rank's `StageLayout` from the (already validated) config."""
    return StageLayout(cfg.parallel.pp, cfg.parallel.chunks, pp_rank,
                       cfg.stage_layers)


def p2p_wait(backend: str, local_ranks: int | None = None) -> Callable[[Sequence[Handle]], None]:
    """MPI's blocking wait, or polling with 100 us sleeps on an oversubscribed host."""
    if local_ranks is None:
        raw = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("MPI_LOCALNRANKS") or "1"
        local_ranks = int(raw) if raw.isdigit() else 1
    if backend != "mpi" or local_ranks <= len(os.sched_getaffinity(0)):
        return wait_all
    return _polite_wait


def _polite_wait(handles: Sequence[Handle]) -> None:
    while not all(h.is_completed() for h in handles):
        time.sleep(100e-6)
    wait_all(handles)


@dataclass
class Pipeline:
    """What one rank needs to run pipeline steps (built by `build_pipeline`)."""

    cfg: TrainConfig
    comm: Communicator
    layout: StageLayout
    stage: GPTStage
    actions: list[Action]
    spec: P2PSpec
    dp: Communicator
    """The DP group: the loss is averaged over it."""
    embd: Communicator | None
    tied: nn.Parameter | None
    wait: Callable[[Sequence[Handle]], None] = wait_all
    last: StepResult | None = None
    """The last step's result (its timeline is written at the end of the run)."""

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        """Run the schedule on the step's microbatches; returns this rank's loss sum (the
        step's loss of this DP replica on the last stage, 0 elsewhere)."""
        self.stage.begin_step(batch)
        self.last = run_schedule(self.actions, self.stage, self.comm, self.spec,
                                 v=self.layout.v, wait=self.wait)
        loss = torch.zeros((), device=self.spec.device)
        for value in self.last.outputs.values():
            loss = loss + at_least_fp32(value)
        return loss

    def sum_shared_grads(self, weights: MainWeights) -> None:
        """Sum the tied embedding's gradient over the first and last stage (after DP)."""
        if self.embd is not None and self.tied is not None:
            weights.sum_grad(self.tied, self.embd)

    def reduce_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The global batch's loss on every rank, a 0-d tensor left on the device: DP average,
        then from the last stage."""
        loss = loss_sum.reshape(1).clone()
        self.dp.all_reduce(loss, ReduceOp.AVG)
        self.comm.broadcast(loss, self.comm.size - 1)
        return loss.reshape(())

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, *docs: torch.Tensor
                  ) -> torch.Tensor | None:
        """The microbatch's mean loss, forward only, stage after stage: the rank of stage s
        receives the activation from stage s-1, runs its layers and sends to stage s+1 (with
        virtual chunks, stage s is chunk s // p of rank s % p). The last stage returns the
        loss, the others None."""
        model, layout, comm = self.stage.model, self.layout, self.comm
        h = torch.empty(0)
        for stage in range(comm.rank, layout.num_stages, layout.p):
            chunk = stage // layout.p
            if layout.is_first(chunk):
                h = model.embed(x)
            else:
                h = torch.empty((*x.shape, model.cfg.d_model), device=x.device,
                                dtype=next(model.parameters()).dtype)
                comm.recv(h, (stage - 1) % layout.p)
            for i in layout.layers(chunk):
                h = model.blocks[str(i)](h, model.rope_cos, model.rope_sin, *docs)
            if layout.is_last(chunk):
                return model.head_loss(h, y)
            comm.send(h.contiguous(), (stage + 1) % layout.p)
        return None

    def report(self, run_dir: Path, *, write: bool) -> str:
        """The last step's timeline and bubble (`write_timeline`)."""
        return write_timeline(self, run_dir, write=write)


def build_pipeline(cfg: TrainConfig, model: GPT, layout: StageLayout, pp: Communicator,
                   dp: GradSync, dp_group: Communicator, device: torch.device) -> Pipeline:
    """The schedule, stage, p2p shape and embedding group of this rank (collective over pp)."""
    schedule = build(cfg.parallel.schedule, cfg.parallel.pp, cfg.parallel.microbatches, layout.v)
    check_schedule(schedule, cfg.parallel.pp, layout.v, m=cfg.parallel.microbatches)
    micro_batch = cfg.micro_batch
    dtype = next(model.parameters()).dtype
    # A stage sends its rank's tokens (1/cp of the sequence under context parallelism), and
    # under sequence parallelism its block of them (trainer.activations).
    seq = cfg.gpt.seq_len // cfg.parallel.cp // (cfg.parallel.tp if
                                                 cfg.parallel.sequence_parallel else 1)
    spec = P2PSpec((micro_batch, seq, cfg.gpt.d_model), dtype, str(device))
    agree_on_spec(pp, spec)

    def grad_sync(final: bool) -> AbstractContextManager[None]:
        # DP reduces on the last backward of each chunk only
        return nullcontext() if final else dp.no_sync()

    stage = GPTStage(model, layout, grad_sync=grad_sync)
    return Pipeline(cfg, pp, layout, stage, schedule[pp.rank], spec, dp_group,
                    embd=_embedding_group(pp, layout, cfg.gpt.tied),
                    tied=tied_weight(model, layout), wait=p2p_wait(pp.backend))


def _embedding_group(pp: Communicator, layout: StageLayout, tied: bool) -> Communicator | None:
    """The first and last rank of the pipeline (collective over pp when tied)."""
    if not tied:
        return None
    ends = layout.holds_first or layout.holds_last
    group = pp.split(0 if ends else 1 + pp.rank, pp.rank, name="embd")
    return group if ends else None


def describe_pipeline(cfg: TrainConfig) -> str:
    """The banner's pipeline part, e.g. ``interleaved, v 2, 8 microbatches, layers 0|1|2|3``."""
    par = cfg.parallel
    v = par.chunks
    return (f"{par.schedule}{f', v {v}' if v > 1 else ''}, {par.microbatches} microbatch(es), "
            f"layers {describe(cfg.stage_layers)}")


def write_timeline(pipe: Pipeline, run_dir: Path, *, write: bool) -> str:
    """Gather the last step's timeline over this pipeline (collective over pp); with ``write``
    save the Perfetto JSON and the Gantt PNG in ``run_dir``. Returns the bubble line."""
    if pipe.last is None:
        return ""
    events = gather(pipe.comm, pipe.last.timeline, pipe.spec.device)
    p, m, v = pipe.comm.size, pipe.cfg.parallel.microbatches, pipe.layout.v
    stats = bubble(events, p)
    ideal = theory(pipe.cfg.parallel.schedule, p, m, v)
    title = f"{pipe.cfg.parallel.schedule} p={p} m={m}" + (f" v={v}" if v > 1 else "")
    line = (f"pipeline ({title}), last step: measured bubble {stats.mean_idle_over_busy:.1%} "
            f"of compute ({stats.mean_idle_over_span:.1%} of the step), theory {ideal:.1%}")
    if not write:
        return line
    # The run has finished and saved: a picture that cannot be written is a warning only.
    warnings = [draw(lambda tmp: write_chrome_trace(tmp, events, title=title),
                     run_dir / TIMELINE_JSON),
                draw(lambda tmp: write_gantt(tmp, events, title=f"last step: {title}"),
                     run_dir / TIMELINE_PNG)]
    if any(warnings):
        return "\n".join([line, *filter(None, warnings)])
    return f"{line}; timeline in {run_dir / TIMELINE_JSON} and {TIMELINE_PNG}"
