"""Memory per GPU, communication per step and link, step time and MFU of one layout, the layouts
a cluster allows, and their ranking.

A layout is a `TrainConfig` (the run the plan describes, checked by the trainer's own rules, so
a combination the trainer refuses is refused here with the trainer's reason). Memory: the
rank's parameters from `trainer.plan.shapes` priced by the trainer's bytes-per-parameter
accounting (`trainer.parallel.zero.memory.expected_bytes`), activations measured on the trainer's
model
times the microbatches the pipeline schedule keeps in flight (`trainer.parallel.pipeline.schedule`).

The cost model (`ASSUMPTIONS`, printed with every plan):

* compute: the busiest rank's own work in a step, counted on the trainer's model
  (`trainer.plan.operations`: recomputation's second forward, sequence parallelism's gathers
  as the run executes them): the FLOPs of its matrix products and attention at ``efficiency``
  x peak, plus the bytes its other operations read and write at the device's memory
  bandwidth; and the host's time to issue its operations, operations x seconds per operation
  (a GPU: the longer of device and host time, as its host issues ahead; a CPU: their sum);
* pipeline bubble: (pp - 1) / (v · m) of the compute added;
* tensor parallelism: four all-reduces (or all-gather + reduce-scatter pairs under sequence
  parallelism) of a block's activations per block and microbatch, exposed;
* data parallelism: ring all-reduce (or reduce-scatter + all-gather under ZeRO-1/2) of the
  gradients over dp x cp, hidden behind the backward pass (2/3 of the compute) except what is
  longer; ZeRO-2/3 reduce every microbatch, ZeRO-3 gathers the blocks once more for the
  backward pass (about 3x the parameter bytes, ZeRO paper; `trainer.plan.sends`);
* pipeline p2p: one activation and one gradient per microbatch and stage boundary, exposed;
* experts: dispatch and combine all-to-all of the routed tokens, forward and backward, exposed;
* context parallelism: the K/V exchange of every layer (`trainer.plan.sends`), exposed;
* every collective: its bytes at the group's bandwidth plus its message steps (ring: 2(n-1)
  an all-reduce, n-1 an all-gather, reduce-scatter or all-to-all, 1 a send) at the link's
  latency per step;
* a group is inside a host while its members span at most one host's GPUs (mesh order
  tp, cp, dp, pp: tp fastest), else it runs at the bandwidth between hosts.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from trainer.config.options import TrainConfig, make_config, resolve_dp
from trainer.errors import ConfigError
from trainer.model.flops import flops_per_token
from trainer.parallel.zero.memory import MemoryTable, expected_bytes, zero3_on_top
from trainer.plan import sends
from trainer.plan.cluster import Cluster
from trainer.plan.routing import measured_rows
from trainer.plan.sends import Comm, unit_sizes
from trainer.plan.shapes import StageParams, activations, rank_params, stage_params

ASSUMPTIONS = (
    "compute: the rank's counted matmul FLOPs at efficiency x peak + the other operations' "
    "bytes at memory bandwidth, and operations x host seconds per operation (GPU: the longer "
    "of the two; CPU: their sum); collectives: bytes / bandwidth + ring message steps x "
    "latency; bubble (pp-1)/(v*m); TP collectives exposed; DP gradient "
    "reduction hidden behind backward (2/3 of compute) except the excess; PP p2p, EP "
    "all-to-all and CP K/V exchange exposed; ring algorithms; a group inside a host while it "
    "spans <= one host's GPUs (mesh order tp, cp, dp, pp)")


@dataclass(frozen=True)
class Memory:
    """Bytes one GPU holds at its peak (the largest rank)."""

    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


@dataclass(frozen=True)
class Estimate:
    """One layout on one cluster."""

    config: TrainConfig
    memory: Memory
    comm: Comm
    step_s: float
    mfu: float
    fits: bool
    why: str = ""
    """Why it does not fit (empty when it does)."""

    @property
    def layout(self) -> str:
        par = self.config.parallel
        parts = [f"dp{par.dp}", f"tp{par.tp}", f"pp{par.pp}"]
        parts += [f"cp{par.cp}" + ("" if par.cp_comm == "allgather" else f" {par.cp_comm}")
                  ] if par.cp > 1 else []
        parts += [f"ep{par.ep}"] if par.ep > 1 else []
        parts += [f"zero{self.config.optimizer.zero}"] if self.config.optimizer.zero else []
        parts += ["sp"] if par.sequence_parallel else []
        parts += [f"recompute-{par.recompute}"] if par.recompute != "none" else []
        parts += [f"m{par.microbatches}"] if par.microbatches > 1 else []
        return " ".join(parts)


def _bf16(cfg: TrainConfig, cluster: Cluster) -> bool:
    precision = cfg.optimizer.precision
    return precision == "bf16" or (precision == "auto" and cluster.name != "cpu")


def in_flight(cfg: TrainConfig) -> list[dict[int, int]]:
    """For each pipeline rank, the most microbatches of each chunk whose activations it holds at
    once, from the schedule the run executes."""
    from trainer.parallel.pipeline.actions import Kind
    from trainer.parallel.pipeline.schedule import build, chunks_of

    par = cfg.parallel
    if par.pp == 1:
        return [{0: 1}]
    v = chunks_of(par.schedule, par.virtual_stages)
    out = []
    for actions in build(par.schedule, par.pp, par.microbatches, v):
        live: dict[int, int] = {}
        most: dict[int, int] = {}
        worst, best = 0, {}
        for a in actions:
            if a.kind == Kind.F:
                live[a.chunk] = live.get(a.chunk, 0) + 1
            elif a.kind == Kind.B:
                live[a.chunk] -= 1
            if sum(live.values()) > worst:
                worst, best = sum(live.values()), dict(live)
            for chunk, n in live.items():
                most[chunk] = max(most.get(chunk, 0), n)
        out.append(best or most)
    return out


def memory(cfg: TrainConfig, cluster: Cluster, *, steps: tuple[int, ...] = (1,)) -> Memory:
    """The largest rank's bytes: parameters, gradients, optimizer state and activations (a
    mixture of experts': the busiest of the run's ``steps``)."""

    par, gpt = cfg.parallel, cfg.gpt
    bf16 = _bf16(cfg, cluster)
    v = par.virtual_stages if par.schedule == "interleaved" else 1
    stages = stage_params(gpt, tp=par.tp, pp=par.pp, v=v)
    act = activations(gpt, tp=par.tp, sequence_parallel=par.sequence_parallel,
                      recompute=par.recompute, micro_batch=cfg.micro_batch,
                      dtype="bf16" if bf16 else "fp32", cp=par.cp, exchange=par.cp_comm)
    counts = cfg.stage_layers
    flights = in_flight(cfg)
    # The experts' matrix products save their weights; the activations were measured with
    # every expert of a block local, a rank holds 1/ep of them (MoE on every layer assumed).
    moe_layers = len(range(0, gpt.n_layer, gpt.moe.every)) if gpt.moe.experts else 0
    width = 2 if bf16 else 4
    remote = (width * stages[0].expert * par.pp // moe_layers * (par.ep - 1) // par.ep
              if moe_layers else 0)
    # The rows a rank's experts run follow the run's routing (`trainer.plan.routing`), not the
    # random tokens the activations were measured with.
    rows = measured_rows(cfg, steps) if moe_layers else None
    if rows is not None:
        act = replace(act, per_block=act.per_block + round(
            act.expert_row_bytes * (rows - act.expert_rows)))
    # Backward re-runs one block (or attention core) at a time, which saves what it did not
    # keep: its activations, and under full recomputation its weights again (a forward under
    # recomputation saves none; measured, tests/trainer/test_layout_planner.py).
    recomputed = 0
    if par.recompute != "none":
        kept = activations(gpt, tp=par.tp, sequence_parallel=par.sequence_parallel,
                           recompute="none", micro_batch=cfg.micro_batch,
                           dtype="bf16" if bf16 else "fp32", cp=par.cp, exchange=par.cp_comm)
        again = kept.weights_per_block - act.weights_per_block
        recomputed = kept.per_block - act.per_block + (again - remote if again else 0)
    best: Memory | None = None
    for rank, params in enumerate(stages):
        table = _in_flight_shards(cfg, _between_steps(cfg, params, bf16), bf16, rank)
        held, rest = 0, 0
        for chunk, live in flights[rank].items():
            stage = chunk * par.pp + rank
            layers = counts[stage] if par.pp > 1 else gpt.n_layer
            last = stage == len(counts) - 1 or par.pp == 1
            held += live * layers * act.per_block
            held += layers * max(0, act.weights_per_block - remote)
            rest = max(rest, act.rest + act.weights_rest if last else 0)
        # The head's and loss's tensors (its weight too) are freed before the first block is
        # re-run.
        mem = Memory(table.params, table.grads, table.optimizer, held + max(rest, recomputed))
        if best is None or mem.total > best.total:
            best = mem
    assert best is not None
    return best


def model_state(cfg: TrainConfig, *, bf16: bool) -> tuple[MemoryTable, MemoryTable]:
    """The largest rank's parameters, gradients and optimizer state: between steps (the
    bytes-per-parameter table) and at the peak of a step (`_in_flight_shards` added)."""
    par = cfg.parallel
    v = par.virtual_stages if par.schedule == "interleaved" else 1
    tables = [_between_steps(cfg, p, bf16)
              for p in stage_params(cfg.gpt, tp=par.tp, pp=par.pp, v=v)]
    peaks = [_in_flight_shards(cfg, t, bf16, rank) for rank, t in enumerate(tables)]
    return max(tables, key=lambda t: t.total), max(peaks, key=lambda t: t.total)


def _between_steps(cfg: TrainConfig, params: StageParams, bf16: bool) -> MemoryTable:
    """The bytes-per-parameter table of a stage's parameters on one rank (its 1/ep of the
    experts), sharded as the run shards them (`trainer.config.sections.ParallelSection`):
    the dense ones over their copies, dp x cp, or under hybrid sharding over the shard
    group; the experts over their expert-data-parallel group."""
    par = cfg.parallel
    experts = params.expert // par.ep
    return expected_bytes(params.dense + experts, bf16=bf16, zero=cfg.optimizer.zero,
                          dp=par.zero_over, experts=experts, experts_over=par.expert_zero_over)


def _in_flight_shards(cfg: TrainConfig, table: MemoryTable, bf16: bool, rank: int = 0
                      ) -> MemoryTable:
    """ZeRO-2/3's peak in a step on top of the shards of pipeline rank ``rank``: ZeRO-2's
    staged gradient buckets, the trainer's own buckets of the rank's gradient buffer
    (`trainer.parallel.zero.layout.shard_layout`) replayed through its staging accounting
    (`trainer.parallel.zero.grad_shards.peak_staged_bytes`: the bucket being filled and
    `IN_FLIGHT` reducing); ZeRO-3 gathers the root and prefetch + 1 blocks and stages as many
    blocks' gradients where the reductions overlap backward, else one (`zero3_on_top`,
    measured by tests/trainer/test_zero3_memory.py)."""
    zero, par = cfg.optimizer.zero, cfg.parallel
    if zero < 2:
        return table
    # Unset: overlapped, as on the GPUs (NCCL) plans are for (`reduction_schedule`); off, each
    # reduction is waited for at its launch, so none is in flight beside the one filling.
    overlap = par.overlap is not False and par.zero_over > 1
    if zero == 3:
        block, root = unit_sizes(cfg)
        prefetch = cfg.optimizer.zero_prefetch
        top = zero3_on_top(root=root, block=block, prefetch=prefetch,
                           in_flight=prefetch if overlap else 0, bf16=bf16)
        return MemoryTable(params=table.params + top.params, grads=table.grads + top.grads,
                           optimizer=table.optimizer)
    from trainer.parallel.zero.grad_shards import IN_FLIGHT, peak_staged_bytes
    from trainer.parallel.zero.layout import shard_layout

    params = rank_params(cfg.gpt, tp=par.tp, pp=par.pp)[rank]
    shards = par.zero_over
    layout = shard_layout(params.numels, par.bucket_size, shards, 0, params.alone)
    wire = 2 if par.grad_reduce_dtype != "fp32" and shards > 1 else 4  # staging: fp32
    staged = peak_staged_bytes([b.end - b.start for b in layout.buckets],
                               in_flight=IN_FLIGHT if overlap else 0,
                               rounds=par.microbatches, main_bytes=4, wire_bytes=wire)
    return MemoryTable(params=table.params, grads=table.grads + staged,
                       optimizer=table.optimizer)


def comm(cfg: TrainConfig, cluster: Cluster, *, steps: tuple[int, ...] = (1,)) -> Comm:
    """Bytes the busiest rank sends per step in each kind of group (`trainer.plan.sends`),
    mean over the run's ``steps`` (the experts' all-to-all depends on the step's data)."""
    return sends.comm(cfg, bf16=_bf16(cfg, cluster), steps=steps)


def step_time(cfg: TrainConfig, cluster: Cluster, traffic: Comm, efficiency: float
              ) -> tuple[float, float]:
    """(seconds per step, MFU) under `ASSUMPTIONS`."""
    from trainer.parallel.data.buckets import plan_buckets
    from trainer.plan.operations import rank_step

    par, gpt, gpu = cfg.parallel, cfg.gpt, cluster.gpu
    model_flops = flops_per_token(gpt) * cfg.data.global_batch * gpt.seq_len
    work = rank_step(cfg, bf16=_bf16(cfg, cluster))
    device = work.flops / (gpu.peak_flops * efficiency)
    device += work.bytes / gpu.memory_bw if gpu.memory_bw > 0 else 0.0
    host = work.ops * gpu.op_s
    compute = max(device, host) if gpu.host_overlaps else device + host
    v = par.virtual_stages if par.schedule == "interleaved" else 1
    bubble = (par.pp - 1) / (v * par.microbatches) if par.pp > 1 else 0.0
    spans = {"tp": par.tp, "cp": par.tp * par.cp, "dp": par.tp * par.cp * par.dp,
             "pp": par.tp * par.cp * par.dp * par.pp, "ep": par.tp * par.cp * par.ep}
    # Message steps: the model's tp and cp collectives as counted; dp's per bucket of the
    # trainer's (ZeRO-3: per unit) and collective; one per pipeline send; five all-to-alls
    # (counts, dispatch and combine forward and back) per MoE layer and microbatch.
    dp_group, m = par.dp * par.cp, par.microbatches
    if cfg.optimizer.zero == 3:
        dp_steps = m * 3 * (gpt.n_layer // par.pp + 1) * (dp_group - 1)
    else:
        numels = max((r.numels for r in rank_params(gpt, tp=par.tp, pp=par.pp)), key=sum)
        per_bucket = {0: 2, 1: 2, 2: m + 1}[cfg.optimizer.zero] * (dp_group - 1)
        dp_steps = len(plan_buckets(numels, par.bucket_size)) * per_bucket
    moe_layers = len(range(0, gpt.n_layer, gpt.moe.every)) if gpt.moe.experts else 0
    steps = {"tp": work.tp_steps, "cp": work.cp_steps, "dp": dp_steps,
             "pp": m * sends.pp_sends(cfg), "ep": m * moe_layers * 5 * (par.ep - 1)}
    comm_s = {k: getattr(traffic, k) / cluster.bandwidth(span)
              + steps[k] * cluster.latency(span) for k, span in spans.items()}
    exposed_dp = max(0.0, comm_s["dp"] - compute * 2 / 3)
    step = (compute * (1 + bubble) + comm_s["tp"] + comm_s["cp"] + comm_s["pp"]
            + comm_s["ep"] + exposed_dp)
    return step, model_flops / (step * cluster.gpus * gpu.peak_flops)


def estimate(cfg: TrainConfig, cluster: Cluster, *, efficiency: float = 0.5,
             steps: tuple[int, ...] = (1,)) -> Estimate:
    """Memory, traffic and time of ``cfg`` on ``cluster`` (a mixture of experts' routing:
    that of the run's ``steps``)."""
    mem = memory(cfg, cluster, steps=steps)
    traffic = comm(cfg, cluster, steps=steps)
    step, mfu = step_time(cfg, cluster, traffic, efficiency)
    fits = mem.total <= cluster.gpu.memory_bytes
    why = "" if fits else (f"needs {mem.total / 2**30:.1f} GiB per GPU, "
                           f"{cluster.gpu.memory_bytes / 2**30:.1f} GiB available")
    return Estimate(cfg, mem, traffic, step, mfu, fits, why)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(base: Mapping[str, Any], cluster: Cluster) -> Iterator[TrainConfig | ConfigError]:
    """Every layout of ``cluster.gpus`` ranks the trainer accepts for the run ``base`` (options
    by flag name), or the trainer's error for one it refuses."""
    world = cluster.gpus
    experts = int(base.get("moe_experts", 0) or 0)
    seq_len = int(base.get("seq_len", 0) or 0)
    for tp, pp, cp in itertools.product(_divisors(world), repeat=3):
        # cp splits every sequence in 2 x cp chunks (`trainer.parallel.context.checks`)
        if world % (tp * pp * cp) or tp * cp > cluster.gpus_per_host or (
                cp > 1 and seq_len % (2 * cp)):
            continue
        dp = world // (tp * pp * cp)
        eps = [e for e in _divisors(dp) if experts and experts % e == 0] or [1]
        for ep, zero, recompute, sp in itertools.product(
                eps, (0, 1, 2, 3), ("none", "selective", "full"), (False, True)):
            if sp and tp == 1:
                continue
            per_dp = int(base.get("global_batch", 32)) // dp
            m = max((d for d in _divisors(per_dp) if d <= 4 * pp), default=1) if pp > 1 else 1
            try:
                cfg = make_config({**base, "dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep,
                                   "zero": zero,
                                   "recompute": recompute, "sequence_parallel": sp,
                                   "microbatches": m})
                yield resolve_dp(cfg, world)
            except ConfigError as exc:
                yield exc


def plan(base: Mapping[str, Any], cluster: Cluster, *, efficiency: float = 0.5
         ) -> tuple[list[Estimate], list[ConfigError]]:
    """Every accepted layout estimated, fitting ones first by step time; and the refusals."""
    done: list[Estimate] = []
    refused: list[ConfigError] = []
    for item in candidates(base, cluster):
        if isinstance(item, ConfigError):
            refused.append(item)
        else:
            done.append(estimate(item, cluster, efficiency=efficiency))
    done.sort(key=lambda e: (not e.fits, e.step_s, e.memory.total))
    return done, refused
