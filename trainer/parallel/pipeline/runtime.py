"""Run one rank's pipeline schedule: compute on a `Stage`, p2p over a PP `Communicator`.

Every schedule (GPipe, 1F1B, interleaved) runs through the same loop: the action list is split
into steps (`actions.batches`); a compute step calls the stage, a p2p step posts its sends and
receives together with ``comm.batch_p2p`` and waits for all of them, exactly the semantics
`trainer.parallel.pipeline.check` proved deadlock-free for the list.

The runtime knows nothing about models. A `Stage` owns the chunks of this rank and their
autograd state:

* ``forward(mb, chunk, x) -> y``: ``x`` is the received activation (``None`` on stage 0, which
  reads its own microbatch); on the last stage ``y`` is the microbatch's loss;
* ``backward(mb, chunk, dy) -> dx``: ``dy`` is the received gradient of ``y`` (``None`` on the
  last stage, which starts from its loss); ``dx`` is the gradient of ``x`` (ignored on stage 0);
* optionally ``activation_bytes(mb, chunk) -> int``: what the forward keeps for its backward.
  Without it the runtime counts the bytes of ``x`` and ``y``.

Shapes are agreed up front, Megatron-style: every activation and gradient that crosses ranks
has one `P2PSpec` (shape, dtype), receive buffers are allocated from it, and a tensor that does
not fit is refused before it is posted. `agree_on_spec` checks that all ranks use the same one.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from trainer.comm.protocol import Communicator, Handle, P2POp, wait_all
from trainer.parallel.pipeline.actions import Action, Kind, ScheduleError, batches, stage_of
from trainer.parallel.pipeline.timeline import Timeline


@runtime_checkable
class Stage(Protocol):
    def forward(self, microbatch: int, chunk: int, x: torch.Tensor | None) -> torch.Tensor: ...

    def backward(self, microbatch: int, chunk: int, grad: torch.Tensor | None
                 ) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class P2PSpec:
    """The one shape and dtype of every tensor that crosses ranks (activations and grads)."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    device: str = "cpu"


@dataclass
class StepResult:
    """What one rank saw in one step: the last stage's outputs (losses) by (microbatch, chunk),
    its timeline, and the activations it held: peak bytes and peak count."""

    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    timeline: Timeline = field(default_factory=lambda: Timeline(0))
    peak_activation_bytes: int = 0
    max_in_flight: int = 0


def check_boundary(t: torch.Tensor, spec: P2PSpec, where: str) -> None:
    """Refuse a tensor that does not fit the agreed p2p shape/dtype (its peer would misread)."""
    if tuple(t.shape) != tuple(spec.shape) or t.dtype != spec.dtype:
        raise ScheduleError(
            "stage output does not fit the agreed p2p tensor", where,
            f"it is {tuple(t.shape)} {t.dtype}, the pipeline agreed on {tuple(spec.shape)} "
            f"{spec.dtype}",
            "Make every stage boundary produce the P2PSpec shape and dtype (or change the spec)")


def agree_on_spec(comm: Communicator, spec: P2PSpec) -> None:
    """Collective: every rank of ``comm`` must pass the same shape and dtype; raise on every rank
    otherwise (instead of a hang or a silently misread tensor later)."""
    code = [len(spec.shape), *spec.shape, zlib.crc32(str(spec.dtype).encode())]
    width = 10
    if len(code) > width:
        raise ScheduleError("p2p tensor has too many dimensions", f"shape={spec.shape}",
                            f"at most {width - 2} are supported", "Flatten the boundary tensor")
    mine = torch.tensor(code + [0] * (width - len(code)), dtype=torch.int64, device=spec.device)
    every = torch.empty(comm.size * width, dtype=torch.int64, device=spec.device)
    comm.all_gather(every, mine)
    rows = every.cpu().view(comm.size, width).tolist()
    if any(row != rows[0] for row in rows):
        shapes = "; ".join(f"rank {r}: {tuple(row[1:1 + row[0]])}" for r, row in enumerate(rows))
        raise ScheduleError(
            "pipeline ranks disagree on the p2p tensor", f"{comm.name} rank {comm.rank}",
            f"shapes/dtypes differ ({shapes}; dtype codes "
            f"{sorted({row[1 + row[0]] for row in rows})})",
            "Build every stage with the same P2PSpec (micro-batch size, sequence length, hidden "
            "size, dtype)")


class _Runner:
    def __init__(self, stage: Stage, comm: Communicator, spec: P2PSpec, v: int,
                 clock: Callable[[], float], t0: float,
                 wait: Callable[[Sequence[Handle]], None]) -> None:
        self.stage, self.comm, self.spec, self.v, self.wait = stage, comm, spec, v, wait
        self.rank, self.p = comm.rank, comm.size
        self.clock, self.t0 = clock, t0
        self.inbox: dict[tuple[str, int, int], torch.Tensor] = {}
        self.outbox: dict[tuple[str, int, int], torch.Tensor] = {}
        self.held: dict[tuple[int, int], int] = {}
        self.result = StepResult(timeline=Timeline(self.rank))
        self.measure = getattr(stage, "activation_bytes", None)

    def run(self, actions: Sequence[Action]) -> StepResult:
        for step in batches(actions):
            start = self.clock() - self.t0
            if step[0].kind.is_comm:
                self._p2p(step)
                label = " ".join(str(a) for a in step)
                self.result.timeline.record("P2P", -1, -1, start, self.clock() - self.t0, label)
            else:
                a = step[0]
                (self._forward if a.kind is Kind.F else self._backward)(a)
                self.result.timeline.record(a.kind.value, a.microbatch, a.chunk, start,
                                            self.clock() - self.t0)
        return self.result

    def _where(self, a: Action) -> str:
        return f"pp rank {self.rank}, stage {stage_of(self.rank, a.chunk, self.p)}, {a}"

    def _forward(self, a: Action) -> None:
        s = stage_of(self.rank, a.chunk, self.p)
        x = self._take(("act", a.microbatch, a.chunk), a) if s > 0 else None
        y = self.stage.forward(a.microbatch, a.chunk, x)
        if s < self.v * self.p - 1:
            self.outbox[("act", a.microbatch, a.chunk)] = y
        else:
            self.result.outputs[(a.microbatch, a.chunk)] = y.detach()
        held = (self.measure(a.microbatch, a.chunk) if self.measure
                else _nbytes([t for t in (x, y) if t is not None]))
        self.held[(a.microbatch, a.chunk)] = held
        self.result.max_in_flight = max(self.result.max_in_flight, len(self.held))
        self.result.peak_activation_bytes = max(self.result.peak_activation_bytes,
                                                sum(self.held.values()))

    def _backward(self, a: Action) -> None:
        s = stage_of(self.rank, a.chunk, self.p)
        last = s == self.v * self.p - 1
        grad = None if last else self._take(("grad", a.microbatch, a.chunk), a)
        dx = self.stage.backward(a.microbatch, a.chunk, grad)
        if s > 0:
            if dx is None:
                raise ScheduleError("stage backward returned no input gradient",
                                    self._where(a), "stage > 0 must send one to stage s-1",
                                    "Return x.grad from Stage.backward")
            self.outbox[("grad", a.microbatch, a.chunk)] = dx
        self.held.pop((a.microbatch, a.chunk), None)

    def _take(self, key: tuple[str, int, int], a: Action) -> torch.Tensor:
        if key not in self.inbox:
            raise ScheduleError("pipeline input missing", self._where(a),
                                f"no {key[0]} for microbatch {key[1]} was received first",
                                "Run a schedule that passed trainer.parallel.pipeline.check")
        return self.inbox.pop(key)

    def _p2p(self, step: Sequence[Action]) -> None:
        ops = []
        for a in step:
            key = ("act" if a.kind in (Kind.SEND_F, Kind.RECV_F) else "grad", a.microbatch,
                   a.chunk)
            if a.kind.is_send:
                if key not in self.outbox:
                    raise ScheduleError("nothing to send", self._where(a),
                                        "its compute has not run on this rank",
                                        "Run a schedule that passed "
                                        "trainer.parallel.pipeline.check")
                t = self.outbox.pop(key)
                check_boundary(t, self.spec, self._where(a))
                ops.append(P2POp("send", t.detach().contiguous(), a.to))
            else:
                buf = torch.empty(self.spec.shape, dtype=self.spec.dtype, device=self.spec.device)
                self.inbox[key] = buf
                ops.append(P2POp("recv", buf, a.to))
        self.wait(self.comm.batch_p2p(ops))


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of distinct storages (an output that is a view of its input counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def run_schedule(actions: Sequence[Action], stage: Stage, comm: Communicator, spec: P2PSpec, *,
                 v: int = 1, clock: Callable[[], float] = time.perf_counter,
                 t0: float | None = None,
                 wait: Callable[[Sequence[Handle]], None] = wait_all) -> StepResult:
    """Run this rank's action list (``comm`` is the PP communicator: its rank is the pipeline
    rank). Without ``t0`` a barrier on ``comm`` starts the step, so all ranks share time zero.
    ``wait`` completes each p2p batch's handles (all of them, before the next step)."""
    if t0 is None:
        comm.barrier()
        t0 = clock()
    return _Runner(stage, comm, spec, v, clock, t0, wait).run(actions)
