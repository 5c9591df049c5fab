"""The vocabulary of pipeline schedules: actions, the stage placement, the error (pure).

Chunk c of rank r is stage ``c * p + r`` (Megatron's virtual pipeline placement): stage ``s``
lives on rank ``s % p`` as chunk ``s // p``. See `trainer.parallel.pipeline.schedule` for the
builders.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from trainer.errors import TrainerError


class ScheduleError(TrainerError):
    """A schedule cannot be built for these sizes, or an action list is wrong."""


class Kind(enum.Enum):
    F = "F"
    B = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_comm(self) -> bool:
        return self not in (Kind.F, Kind.B)

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_F, Kind.SEND_B)


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule; ``peer`` is set for (and only for) p2p actions."""

    kind: Kind
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    @property
    def to(self) -> int:
        """The peer rank of a p2p action (-1 for compute, which has none)."""
        return -1 if self.peer is None else self.peer

    def channel(self, rank: int) -> tuple[int, int]:
        """(sender, receiver) of this p2p action when ``rank`` runs it."""
        return (rank, self.to) if self.kind.is_send else (self.to, rank)

    def __str__(self) -> str:
        text = f"{self.kind.value}{self.microbatch}"
        if self.chunk:
            text += f".c{self.chunk}"
        if self.peer is not None:
            text += f"{'->' if self.kind.is_send else '<-'}{self.peer}"
        return text


Schedule = list[list[Action]]


def stage_of(rank: int, chunk: int, p: int) -> int:
    """The pipeline stage that chunk ``chunk`` of rank ``rank`` runs."""
    return chunk * p + rank


def place(stage: int, p: int) -> tuple[int, int]:
    """(rank, chunk) that runs ``stage``."""
    return stage % p, stage // p


def batches(actions: Sequence[Action]) -> list[list[Action]]:
    """Split a rank's list into steps: a compute action alone, or a run of p2p actions posted
    together as one ``batch_p2p``. The runtime and the checker both execute these steps."""
    steps: list[list[Action]] = []
    for action in actions:
        if action.kind.is_comm and steps and steps[-1][0].kind.is_comm:
            steps[-1].append(action)
        else:
            steps.append([action])
    return steps
