"""The agents' view of each rank, as sent to the head in PROGRESS frames (pure).

Times are ages measured on the rank's own host (``now - entered``), so clocks of different
hosts never meet.
"""

from __future__ import annotations

import workerenv
from records import Record

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from typing import Any


class GroupView(Record, frozen=True):
    """One communicator of a rank: the last operation it entered and whether it finished."""

    label: str
    group_rank: int
    group_size: int
    seq: int
    done: int
    op: str
    dtype: str = ""
    p2p: int = 0          # 0 collective, 1 send, 2 recv
    peer: int = -1
    nbytes: int = 0
    age: float = 0.0      # seconds since the rank entered the operation
    # The last operations entered, oldest first, this one included: (seq, op, peer, collectives
    # entered on the group up to it), as `workerenv.GroupProgress.history`.
    history: tuple[tuple[int, str, int, int], ...] = ()

    @property
    def in_flight(self) -> bool:
        return self.done < self.seq

    @property
    def collectives(self) -> int:
        """Collectives entered on the group so far (0 when the history is empty)."""
        return self.history[-1][3] if self.history else 0

    def collective(self, number: int) -> tuple[int, str, int] | None:
        """(seq, op, peer) of the group's collective ``number`` as this rank entered it, while
        its history holds it."""
        return next(((seq, op, peer) for seq, op, peer, count in self.history
                     if count == number and op not in workerenv.PROGRESS_P2P_OPS), None)


class RankView(Record, frozen=True):
    rank: int
    host: str
    pid: int = 0
    state: str = "running"      # running, stopped (SIGSTOP), exited, no-record
    step: int = 0
    step_age: float | None = None    # seconds since the step was reported
    compute_s: float = 0.0
    compute_avg_s: float = 0.0
    groups: tuple[GroupView, ...] = ()
    cpu_share: float = 0.0           # of one core, over the agent's last half second or more
    first_step: int = 0              # the first step this process reported (a resume's S+1)
    first_step_age: float | None = None  # seconds since it was reported
    # Seconds since it entered the PMI barrier it is in (MPI_Init's wire-up or MPI_Finalize:
    # `launcher.hang.mpi`); None when it is in none.
    fence_age: float | None = None
    # Where its groups come from: "" its own record (trainer.comm), "flight" torch's Flight
    # Recorder (`launcher.agent.flight`): a gloo rank blocks while it waits, it never spins;
    # "flight-spin" the same for NCCL, whose host side spins while it waits.
    recorder: str = ""
    # How an exited rank ended: its exit status (128+N when killed by signal N), None while
    # unknown; ``returned``: it left its main with torch.distributed up (the flight shim's
    # marker), whether or not its process has ended (torch's teardown can hold it).
    code: int | None = None
    returned: bool = False
    # Its main thread was runnable or in disk I/O when read (state R or D): busy even where
    # its share of a core is small (a host loaded many times over, ranks importing).
    runnable: bool = False

    def group(self, label: str) -> GroupView | None:
        return next((g for g in self.groups if g.label == label), None)

    @property
    def waiting(self) -> list[GroupView]:
        """Operations in flight, the longest-waiting first."""
        return sorted((g for g in self.groups if g.in_flight), key=lambda g: -g.age)

    @property
    def position(self) -> tuple[int, tuple[tuple[str, int, int], ...]]:
        """Changes whenever the rank makes any progress (a step, an operation entered or done)."""
        return self.step, tuple((g.label, g.seq, g.done) for g in self.groups)

    def to_json(self) -> dict[str, Any]:
        """As ``records.asdict``, its groups too: every agent sends every rank's view once a
        second (its tuples are encoded as JSON arrays either way).
        The instances' own dicts hold exactly their fields, in order (no slots, nothing
        cached), and copying them takes half the time of reading each field by name, which
        was 3% of the simulated cluster's CPU at 1,024 hosts (yappi, 2026-11-30)."""
        body = dict(vars(self))
        body["groups"] = [dict(vars(g)) for g in self.groups]
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> RankView:
        groups = tuple(GroupView(**{**g, "history": tuple(map(tuple, g.get("history", ())))})
                       for g in body.get("groups", ()))
        return cls(**{**body, "groups": groups})


def view_of(record: workerenv.RankProgress | None, *, rank: int, host: str, state: str,
            now: float, **agent: Any) -> RankView:
    """A rank's view from its decoded record (None: the rank has not written one yet);
    ``agent``: the fields the agent adds from its own readings (pid, cpu_share, fence_age,
    code, returned, runnable, recorder), set here rather than by a copy of the view."""
    if record is None:
        return RankView(rank, host, state="no-record" if state == "running" else state, **agent)
    groups = tuple(GroupView(g.label, g.group_rank, g.group_size, g.seq, g.done, g.op, g.dtype,
                             g.p2p, g.peer, g.nbytes, max(0.0, now - g.entered_at), g.history)
                   for g in record.groups)
    fields = {"pid": record.pid, **agent}  # the agent's pid, when it gives one, is the same
    return RankView(rank, host, state=state, step=record.step,
                    step_age=max(0.0, now - record.step_at) if record.step_at else None,
                    compute_s=record.compute_s, compute_avg_s=record.compute_avg_s,
                    groups=groups, first_step=record.first_step,
                    first_step_age=max(0.0, now - record.first_step_at)
                    if record.first_step_at else None, **fields)
