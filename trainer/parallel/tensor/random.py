"""Random streams for dropout under tensor parallelism, and activation recompute that keeps them.

Two kinds of dropout exist in a TP model (Megatron ``tensor_parallel/random.py``):

* **Outside TP regions** (embedding, residual branches after a row-parallel sum) the
  activations are replicated on every TP rank, so the masks must be *identical* across the TP
  group, or the replicas drift apart. These draw from the device's default generator, which the
  trainer seeds the same on every TP rank of a DP replica.
* **Inside TP regions** (attention probabilities of this rank's heads) each rank holds a
  different slice of one serial activation, so its mask must be *different* (the serial model
  draws independent masks for different heads). These draw from a tracked stream seeded
  per TP rank, entered with ``with tracker.fork():``.

`RNGStatesTracker` keeps named generator states and swaps one in for the duration of
``fork()``, so drawing from it never disturbs the default stream. `checkpoint` recomputes a
function in backward with the default *and* every tracked state put back as they were in
forward, so the recomputed dropout masks equal the original ones (the reason Megatron's
``CheckpointFunction`` saves the tracker's states; plain ``torch.utils.checkpoint`` restores
only the default generators).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import Function

from trainer.comm.mesh import Mesh
from trainer.data.batches import step_seed
from trainer.errors import TrainerError

TP_RNG = "tensor-parallel"
"""Name of the stream for dropout inside TP regions."""


class RNGError(TrainerError):
    """A tracked random stream was used wrongly."""


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states of one device (the model's), swapped in by ``fork(name)``."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}

    def seed(self, name: str, seed: int) -> None:
        """(Re)start stream ``name`` from ``seed``, leaving the default stream untouched."""
        if self.device.type == "cuda":
            outer = _get_state(self.device)
            torch.cuda.manual_seed(seed)  # seeds the current device, i.e. self.device
            self._states[name] = _get_state(self.device)
            _set_state(self.device, outer)
        else:
            self._states[name] = torch.Generator().manual_seed(seed).get_state()

    def names(self) -> tuple[str, ...]:
        return tuple(self._states)

    @contextmanager
    def fork(self, name: str = TP_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default stream is restored after."""
        if name not in self._states:
            raise RNGError("unknown random stream", name,
                           f"the tracker has {list(self._states) or 'no streams'}",
                           "Call tracker.seed(name, seed) before forking it (the trainer does "
                           "so at the start of every step)")
        outer = _get_state(self.device)
        _set_state(self.device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(self.device, outer)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {k: v.clone() for k, v in states.items()}


class _Checkpoint(Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[..., torch.Tensor], tracker: RNGStatesTracker,
                *inputs: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.tracker = fn, tracker
        ctx.rng = (_get_state(tracker.device), tracker.get_states())
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        tracker: RNGStatesTracker = ctx.tracker
        now = (_get_state(tracker.device), tracker.get_states())
        _set_state(tracker.device, ctx.rng[0])
        tracker.set_states(ctx.rng[1])
        try:
            with torch.enable_grad():
                out = ctx.fn(*inputs)
        finally:
            _set_state(tracker.device, now[0])
            tracker.set_states(now[1])
        torch.autograd.backward(out, grad)
        return (None, None, *(t.grad if t.requires_grad else None for t in inputs))


def checkpoint(fn: Callable[..., torch.Tensor], tracker: RNGStatesTracker,
               *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)`` without keeping its activations: recomputed in backward under the same
    default and tracked random states, so dropout masks (and results) are unchanged."""
    out: torch.Tensor = _Checkpoint.apply(fn, tracker, *inputs)  # type: ignore[no-untyped-call]  # torch's Function.apply
    return out


_DROPOUT_STREAM = 1
_TP_DROPOUT_STREAM = 2


@dataclass(frozen=True)
class DropoutSeeds:
    """Where a step's dropout streams start: (seed, step, dp rank[, pp rank]), the TP stream
    with the tp rank too."""

    seed: int
    dp_rank: int
    tp_rank: int
    stage: tuple[int, ...]
    """(pp rank,) under PP, else () so that runs without it keep their random streams."""

    @classmethod
    def of(cls, seed: int, mesh: Mesh, *, pipelined: bool) -> DropoutSeeds:
        return cls(seed, mesh.rank("dp"), mesh.rank("tp"), (mesh.rank("pp"),) if pipelined
                   else ())

    def reseed(self, step: int, tracker: RNGStatesTracker) -> None:
        torch.manual_seed(step_seed(self.seed, step, _DROPOUT_STREAM, self.dp_rank, *self.stage))
        tracker.seed(TP_RNG, step_seed(self.seed, step, _TP_DROPOUT_STREAM, self.dp_rank,
                                       self.tp_rank, *self.stage))
