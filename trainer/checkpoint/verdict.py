"""Every rank's verdict on a checkpoint, agreed collectively: the worst wins, and one rank (the
lowest with that verdict) reports it, so a refusal is printed once, not once per rank."""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.checkpoint.layout import CheckpointDamaged, CheckpointError
from trainer.comm.protocol import Communicator, ReduceOp

OK, DAMAGED, FATAL = 0, 1, 2  # a rank's verdict on a checkpoint; the worst one wins
_KEY_BITS = 32


def agree(error: CheckpointError | None, world: Communicator,
          device: torch.device) -> tuple[int, bool]:
    """(the worst verdict of all ranks of ``world``, whether this rank reports it: the lowest
    rank with that verdict); one all-reduce."""
    verdict = OK if error is None else DAMAGED if isinstance(error, CheckpointDamaged) else \
        FATAL
    key, top = world.rank, (1 << _KEY_BITS) - 1
    value = torch.tensor([(verdict << _KEY_BITS) | (top - key)], dtype=torch.int64,
                         device=device)
    world.all_reduce(value, ReduceOp.MAX)
    worst, reporter_key = int(value) >> _KEY_BITS, top - (int(value) & top)
    return worst, worst != OK and reporter_key == key


def quiet(path: Path) -> CheckpointError:
    """What a rank raises when another rank reports why ``path`` is refused."""
    return CheckpointError("checkpoint refused", str(path), "reported by another rank")
