"""The plan of the run being started, against what the run measures (`python -m trainer.train`).

Rank 0 plans the run's own layout and prints the planner's line before the first step (memory per
rank by kind, communication per step by group). The first step of the process is metered as
`bench.memory` meters one: the tensors the rank holds afterwards (parameters, gradient buffer,
optimizer state: `trainer.parallel.zero.memory.held_bytes`) plus the peak of the bytes autograd
saved during it (`SavedTensorMeter`). The largest rank's measured total (one MAX over the world,
once) is compared with the plan's largest rank; more than `TOLERANCE` apart, rank 0 warns once.

Layouts the planner does not model (a mixture of experts without a capacity, whose dispatch
sizes depend on the data) get a line saying so, and no check.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from trainer.comm.protocol import ReduceOp
from trainer.errors import TrainerError
from trainer.plan.cluster import GPU, Cluster

if TYPE_CHECKING:
    from trainer.comm.bootstrap import World
    from trainer.config.options import TrainConfig
    from trainer.plan.estimate import Estimate
    from trainer.training.run import Run

TOLERANCE = 0.10
"""The relative difference between measured and planned bytes per rank that is warned about."""
MIB = 2**20


def not_modelled(cfg: TrainConfig) -> str:
    """Why the planner cannot describe ``cfg`` yet ("" when it can)."""
    if cfg.gpt.moe.experts and cfg.gpt.moe.capacity_factor <= 0:
        return ("a mixture of experts without --moe-capacity-factor is not modelled (its "
                "dispatch sizes depend on the data)")
    return ""


def run_cluster(world_size: int, local_size: int, device: torch.device) -> Cluster:
    """The run's own machines, as far as memory and traffic go (time needs `trainer.plan`'s
    cluster numbers): the device type decides what ``--precision auto`` means."""
    per_host = max(1, local_size)
    hosts = max(1, world_size // per_host)
    return Cluster(hosts, per_host, GPU(0, 0.0), 1.0, 1.0,
                   "cpu" if device.type == "cpu" else device.type)


def plan_of(cfg: TrainConfig, cluster: Cluster) -> Estimate | str:
    """The planner's estimate of ``cfg``, or why there is none."""
    from trainer.plan.estimate import comm, memory

    why = not_modelled(cfg)
    if why:
        return why
    try:
        mem = memory(cfg, cluster)
        traffic = comm(cfg, cluster)
    except TrainerError as exc:
        return str(exc)
    from trainer.plan.estimate import Estimate

    return Estimate(cfg, mem, traffic, 0.0, 0.0, True)


def line(plan: Estimate | str) -> str:
    """Rank 0's start-up line."""
    if isinstance(plan, str):
        return f"dtrain: plan: {plan}; no memory check"
    m, c = plan.memory, plan.comm
    return (f"dtrain: plan ({plan.layout}, largest rank): parameters {m.params / MIB:.1f} MiB + "
            f"gradients {m.grads / MIB:.1f} MiB + optimizer {m.optimizer / MIB:.1f} MiB + "
            f"activations {m.activations / MIB:.1f} MiB = {m.total / MIB:.1f} MiB per rank; "
            f"sends per step: dp {c.dp / 1e6:.2f} MB, tp {c.tp / 1e6:.2f} MB, pp "
            f"{c.pp / 1e6:.2f} MB, ep {c.ep / 1e6:.2f} MB (python -m trainer.plan for the "
            "step time on a cluster)")


def warning(planned: int, measured: int) -> str:
    """The warning when ``measured`` differs from ``planned`` by more than `TOLERANCE`."""
    if planned <= 0 or abs(measured - planned) <= TOLERANCE * planned:
        return ""
    return (f"dtrain: warning: memory per rank [largest rank, after the first step]: measured "
            f"{measured / MIB:.1f} MiB, the plan says {planned / MIB:.1f} MiB "
            f"({100 * (measured - planned) / planned:+.0f}%, more than "
            f"{100 * TOLERANCE:.0f}% apart). The planner's model of this layout is off; "
            "please report it with this line")


def measured_bytes(run: Run, saved_peak: int) -> int:
    """What the rank holds after a step (every gradient buffer, the experts' too), plus what
    it held only during the step (ZeRO-2/3's staged gradient buckets and ZeRO-3's gathered
    units at their peaks, as `bench.memory`'s ``grads peak`` and ``params peak``), plus the
    peak saved for backward during it. The
    peaks are those since they were last reset (ZeRO-2's every step; ZeRO-3's gathered units
    by `trainer.training.budget` or the caller)."""
    from trainer.parallel.zero.memory import held_bytes

    units = getattr(run.weights, "units", None)  # ZeRO-3: the shards are the parameters
    # Every group's gradients: a mixture of experts' reduce over their own groups
    # (`trainer.parallel.data.split`, `trainer.parallel.zero.split`).
    held = held_bytes(run.model.parameters() if units is None else units.shards,
                      run.dp.buffers, run.weights.optimizer)
    during = getattr(run.dp, "peak_staged_bytes", 0)
    if units is not None:
        during += units.peak_gathered_bytes
    return held.total + during + saved_peak


class PlanCheck:
    """The start-up line and the one check after the first step (module docstring)."""

    def __init__(self, run: Run, world: World) -> None:
        self.run, self.world = run, world
        # Only rank 0 plans: 0.1-0.2 s of CPU for a tiny or small model (measured, 2026-11-28).
        # Its fake tensors import torch._dynamo (~1.5 s), but AdamW's add_param_group
        # (torch._disable_dynamo) has imported it in build_run already, in every run. Every rank
        # of a modelled layout takes part in the one MAX after the first step. A mixture of
        # experts is routed by the run's own data only with --plan-routing (it builds the
        # whole model once more); else its plan counts balanced routing.
        why = not_modelled(run.cfg)
        self.plan: Estimate | str = why or (
            plan_of(run.cfg, run_cluster(world.size, world.local_size, world.device))
            if run.is_writer else "planned on rank 0")
        self.line = line(self.plan)
        self.pending = not why
        self.saved_peak = 0
        self.measured = 0

    @contextmanager
    def metered(self) -> Iterator[None]:
        """Meter the first step (after it: `after_first_step`); later steps run as they are."""
        if not self.pending:
            yield
            return
        from trainer.parallel.zero.memory import SavedTensorMeter

        meter = SavedTensorMeter()
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            yield
        self.saved_peak = meter.peak

    def after_first_step(self) -> str:
        """The warning (rank 0 logs it) once, after the metered step; "" otherwise. Every rank
        calls it: the largest rank's bytes are one MAX over the world."""
        if not self.pending:
            return ""
        self.pending = False
        mine = measured_bytes(self.run, self.saved_peak)
        t = torch.tensor([mine], dtype=torch.float64, device=self.world.device)
        self.world.comm.all_reduce(t, ReduceOp.MAX)
        self.measured = int(t.item())
        return "" if isinstance(self.plan, str) else warning(self.plan.memory.total, self.measured)
