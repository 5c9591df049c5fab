"""Stop a diverged run on every rank in the same step, before the bad step is applied or saved.

Per step (`StepGuard.admit`, before ``optimizer.step()``): the loss and the global gradient norm are
the values every rank already agrees on, so no extra collective is needed. The loss is averaged
over DP, identical on every TP rank (vocab-parallel cross entropy reduces over TP) and broadcast
over PP; the norm is summed over TP and PP, and DP ranks hold the same all-reduced gradients. A
NaN or Inf anywhere reaches both values on every rank, so all ranks raise together and nobody
waits in a collective. The step is not applied: the parameters stay those of the last good step.
With ``--skip-nonfinite N`` up to N such steps are skipped instead (the update is dropped, as a
loss scaler drops an overflowing step) and the run stops at the next one.

Per save (`check_parameters`, before a checkpoint is written): parameters can overflow in the
update itself (a huge learning rate times weight decay) while that step's loss and norm were
finite; each rank tests its own parameters and the verdict is reduced over the world, so all
ranks refuse together. Neither check lets a non-finite state reach a checkpoint,
and since nothing is saved, nothing is pruned because of it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from trainer.comm.protocol import Communicator, ReduceOp
from trainer.errors import TrainerError

_FIX = ("Resume from the last checkpoint (--resume) with a lower --lr, more --warmup-steps or "
        "--grad-clip")


class DivergedError(TrainerError):
    """The loss, the gradient norm or the parameters of a run became NaN or infinite."""


@dataclass
class StepGuard:
    """Decides, per step, whether its update may be applied. ``allowed``: how many non-finite
    steps this invocation may skip (``--skip-nonfinite``, like a loss scaler's skipped steps);
    the next one stops the run. The budget is per invocation: a resumed run starts it again."""

    allowed: int = 0
    skipped: list[int] = field(default_factory=list)

    def admit(self, step: int, loss: float | torch.Tensor, grad_norm: float | torch.Tensor, *,
              report: bool) -> bool:
        """True: apply the step. False: skip it (``report`` prints why). Raises when a
        non-finite step exceeds the budget; every rank decides alike (see the docstring).
        Tensors (on the device) are read once, as one bool; their values only when not finite."""
        if _finite(loss, grad_norm):
            return True
        loss, grad_norm = float(loss), float(grad_norm)
        what = f"the loss is {loss} and the global gradient norm {grad_norm}"
        if len(self.skipped) < self.allowed:
            self.skipped.append(step)
            if report:
                print(f"dtrain: step {step} skipped: {what} ({len(self.skipped)} of "
                      f"--skip-nonfinite {self.allowed})", file=sys.stderr, flush=True)
            return False
        used = f" after skipping steps {', '.join(map(str, self.skipped))}" if self.skipped else ""
        raise DivergedError("training diverged", f"step {step}",
                            f"{what}{used}; the step was not applied and no checkpoint of it is "
                            "written", _FIX).everywhere(report=report)


def _finite(*values: float | torch.Tensor) -> bool:
    """Whether every value is finite, with a single host read for device tensors."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not all(math.isfinite(v) for v in values if not isinstance(v, torch.Tensor)):
        return False
    if not tensors:
        return True
    verdict = torch.isfinite(tensors[0])
    for t in tensors[1:]:
        verdict = verdict & torch.isfinite(t)
    return bool(verdict)


def check_parameters(params: Iterable[torch.Tensor], step: int, world: Communicator | None,
                     *, report: bool) -> None:
    """Raise on every rank if any rank of ``world`` (None: this process alone) holds a
    non-finite parameter; called before saving step ``step``."""
    params = list(params)
    device = params[0].device if params else torch.device("cpu")
    bad = torch.tensor([nonfinite(params)], dtype=torch.int64, device=device)
    if world is not None:
        world.all_reduce(bad, ReduceOp.MAX)
    if int(bad):
        raise diverged(step, report=report)


def nonfinite(params: Iterable[torch.Tensor]) -> int:
    """1 when one of ``params`` (this rank's) holds a NaN or an infinity, else 0: the local half
    of `check_parameters`, for a caller that reduces it with other values in one collective."""
    params = list(params)
    if not params:
        return 0
    # A sum is NaN or infinite when any element is, and costs a read of the tensor where
    # isfinite writes a mask as large; only a sum that overflowed (all elements finite, a
    # huge total) sends its tensor to the exact check.
    sums = torch.stack([p.detach().sum() for p in params])  # on the device: one sync
    if bool(torch.isfinite(sums).all()):
        return 0
    return int(not bool(torch.stack([torch.isfinite(p.detach()).all() for p in params]).all()))


def diverged(step: int, *, report: bool) -> TrainerError:
    """The error every rank raises when a rank's parameters are not finite at save ``step``."""
    return DivergedError("training diverged", f"step {step}",
                         "a parameter is NaN or infinite after the update; the checkpoint "
                         "of this step is not written and none is pruned", _FIX
                         ).everywhere(report=report)
