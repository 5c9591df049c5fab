"""Stop a diverged run on every rank in the same step, before the bad step is applied or saved.

Per step (`check_step`, before ``optimizer.step()``): the loss and the global gradient norm are
the values every rank already agrees on, so no extra collective is needed. The loss is averaged
over DP, identical on every TP rank (vocab-parallel cross entropy reduces over TP) and broadcast
over PP; the norm is summed over TP and PP, and DP ranks hold the same all-reduced gradients. A
NaN or Inf anywhere reaches both values on every rank, so all ranks raise together and nobody
waits in a collective. The step is not applied: the parameters stay those of the last good step.

Per save (`check_parameters`, before a checkpoint is written): parameters can overflow in the
update itself (a huge learning rate times weight decay) while that step's loss and norm were
finite; each rank tests its own parameters and the verdict is reduced over the DP, TP and PP
groups, so all ranks refuse together. Neither check lets a non-finite state reach a checkpoint,
and since nothing is saved, nothing is pruned because of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from trainer.comm.protocol import Communicator, ReduceOp
from trainer.errors import TrainerError

_FIX = ("Resume from the last checkpoint (--resume) with a lower --lr, more --warmup-steps or "
        "--grad-clip")


class DivergedError(TrainerError):
    """The loss, the gradient norm or the parameters of a run became NaN or infinite."""


def check_step(step: int, loss: float, grad_norm: float, *, report: bool) -> None:
    """Raise on every rank (``report``: the one that prints) if the step's loss or global
    gradient norm is not finite."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    raise DivergedError("training diverged", f"step {step}",
                        f"the loss is {loss} and the global gradient norm {grad_norm}; the step "
                        "was not applied and no checkpoint of it is written", _FIX
                        ).everywhere(report=report)


def check_parameters(params: Iterable[torch.Tensor], step: int, groups: Sequence[Communicator],
                     *, report: bool) -> None:
    """Raise on every rank if any rank of ``groups`` (together: the world) holds a non-finite
    parameter; called before saving step ``step``."""
    params = list(params)
    device = params[0].device if params else torch.device("cpu")
    finite = [torch.isfinite(p.detach()).all() for p in params]  # on the device: one sync
    bad = torch.zeros(1, dtype=torch.int64, device=device)
    if finite:
        bad += ~torch.stack(finite).all()
    for comm in groups:
        comm.all_reduce(bad, ReduceOp.MAX)
    if int(bad):
        raise DivergedError("training diverged", f"step {step}",
                            "a parameter is NaN or infinite after the update; the checkpoint "
                            "of this step is not written and none is pruned", _FIX
                            ).everywhere(report=report)
