"""Static check of a pipeline schedule: simulate every rank's action list, run nothing.

`check_schedule` executes the lists the way `trainer.parallel.pipeline.runtime` does, as steps of
`schedule.batches` (a compute action, or a batch of p2p actions posted together and completed
together), under the strictest p2p semantics there is: a send completes only once the matching
receive is posted (NCCL's rendezvous; MPI may buffer small sends, which can only help).
Messages between two ranks pair up in posting order, as on MPI with one tag and on NCCL.

It raises `ScheduleError` when

* a send and the receive it pairs with disagree on what travels (an activation or a gradient,
  which microbatch, which stage): the runtime would silently put one tensor into the other's
  place;
* no rank can move and some have not finished (deadlock), naming what each rank waits for;
* a dependency is broken: a forward without its input from stage s-1, a backward before its own
  forward or without the gradient from stage s+1, a send of something not computed yet, an action
  twice, a peer that is not the neighbouring stage's rank;
* a rank misses a forward or backward of some microbatch and chunk.

Because a received message must carry exactly (microbatch, stage s) and its send may only follow
the compute that produced it, "F of stage s after F of stage s-1" and "B of stage s after B of
stage s+1" hold by construction of every run, not merely in the simulated order.

It returns the maximum number of (microbatch, chunk) activations each rank holds at once (a
forward's activations live until its backward), and the timing of an ideal run: every F costs
``cost_f``, every B ``cost_b``, p2p is free, and a batch ends when its last partner arrives. Its
bubble is the schedule's own, free of any machine noise: exactly (p-1)/m for GPipe and 1F1B.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from trainer.parallel.pipeline.actions import Action, Kind, ScheduleError, batches, place, stage_of

Payload = tuple[str, int, int]  # ("act" | "grad", microbatch, stage it is for)


@dataclass(frozen=True)
class CheckResult:
    """What the simulation learned: peak in-flight activations per rank, messages sent, and the
    ideal run's compute intervals per rank ((action, start, end)) and its span."""

    max_in_flight: tuple[int, ...]
    messages: int
    compute: tuple[tuple[tuple[Action, float, float], ...], ...] = ()
    span: float = 0.0

    @property
    def bubble(self) -> float:
        """Ideal idle time over compute time, averaged over ranks (compare with (p-1)/m)."""
        ratios = []
        for intervals in self.compute:
            busy = sum(end - start for _, start, end in intervals)
            ratios.append((self.span - busy) / busy if busy else 0.0)
        return sum(ratios) / len(ratios) if ratios else 0.0


@dataclass
class _Post:
    rank: int
    action: Action
    payload: Payload
    at: float  # when it was posted in the ideal run
    matched: bool = False
    done_at: float = 0.0  # when its partner had been posted too


@dataclass
class _Rank:
    rank: int
    steps: list[list[Action]]
    pos: int = 0
    posted: list[_Post] = field(default_factory=list)
    computed: set[tuple[Kind, int, int]] = field(default_factory=set)
    sent: set[tuple[Kind, int, int]] = field(default_factory=set)
    inbox: set[Payload] = field(default_factory=set)
    in_flight: int = 0
    max_in_flight: int = 0
    clock: float = 0.0
    intervals: list[tuple[Action, float, float]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.pos == len(self.steps)


class _Sim:
    def __init__(self, actions: Sequence[Sequence[Action]], p: int, v: int,
                 costs: tuple[float, float]) -> None:
        self.p, self.v, self.last = p, v, v * p - 1
        self.costs = {Kind.F: costs[0], Kind.B: costs[1]}
        self.ranks = [_Rank(r, batches(a)) for r, a in enumerate(actions)]
        self.sends: dict[tuple[int, int], list[_Post]] = {}
        self.recvs: dict[tuple[int, int], list[_Post]] = {}
        self.messages = 0

    def run(self) -> None:
        while not all(r.done for r in self.ranks):
            moved = False
            for rank in self.ranks:
                while self._advance(rank):
                    moved = True
            if not moved:
                raise self._deadlock()

    def _advance(self, st: _Rank) -> bool:
        if st.done:
            return False
        step = st.steps[st.pos]
        if not step[0].kind.is_comm:
            self._compute(st, step[0])
        elif not st.posted:
            st.posted = [self._post(st, a) for a in step]
            return True
        elif all(post.matched for post in st.posted):
            st.clock = max(post.done_at for post in st.posted)
            st.posted = []
        else:
            return False
        st.pos += 1
        return True

    # -- compute ------------------------------------------------------------------------------

    def _compute(self, st: _Rank, a: Action) -> None:
        s = stage_of(st.rank, a.chunk, self.p)
        key = (a.kind, a.microbatch, a.chunk)
        if key in st.computed:
            raise self._error(st, a, "it runs twice", "Run every forward and backward once")
        if a.kind is Kind.F:
            self._consume(st, a, ("act", a.microbatch, s), s > 0, f"stage {s - 1}")
            st.in_flight += 1
            st.max_in_flight = max(st.max_in_flight, st.in_flight)
        else:
            if (Kind.F, a.microbatch, a.chunk) not in st.computed:
                raise self._error(st, a, "it runs before its own forward",
                                  "Place every B after the F of the same microbatch and chunk")
            self._consume(st, a, ("grad", a.microbatch, s), s < self.last, f"stage {s + 1}")
            st.in_flight -= 1
        st.computed.add(key)
        start, st.clock = st.clock, st.clock + self.costs[a.kind]
        st.intervals.append((a, start, st.clock))

    def _consume(self, st: _Rank, a: Action, need: Payload, needed: bool, source: str) -> None:
        if not needed:
            return
        if need not in st.inbox:
            what = "input activation" if need[0] == "act" else "output gradient"
            raise self._error(st, a, f"its {what} from {source} has not been received",
                              "Put the matching RECV before it")
        st.inbox.remove(need)

    # -- p2p ----------------------------------------------------------------------------------

    def _post(self, st: _Rank, a: Action) -> _Post:
        s = stage_of(st.rank, a.chunk, self.p)
        forward = a.kind in (Kind.SEND_F, Kind.RECV_F)
        other = s + 1 if a.kind in (Kind.SEND_F, Kind.RECV_B) else s - 1
        if not 0 <= other <= self.last:
            raise self._error(st, a, f"stage {s} has no stage {other} to exchange with",
                              "Drop this action")
        if a.peer != place(other, self.p)[0]:
            raise self._error(st, a, f"stage {other} runs on rank {place(other, self.p)[0]}",
                              "Address the rank of the neighbouring stage")
        kind = "act" if forward else "grad"
        if a.kind.is_send:
            made = (Kind.F if forward else Kind.B, a.microbatch, a.chunk)
            if made not in st.computed:
                raise self._error(st, a, f"{made[0].value}{a.microbatch} has not run yet",
                                  "Send a result only after the compute that produces it")
            if (a.kind, a.microbatch, a.chunk) in st.sent:
                raise self._error(st, a, "it is sent twice", "Send every result once")
            st.sent.add((a.kind, a.microbatch, a.chunk))
            post = _Post(st.rank, a, (kind, a.microbatch, other), st.clock)
        else:
            post = _Post(st.rank, a, (kind, a.microbatch, s), st.clock)
        self._pair(a.channel(st.rank), post)
        return post

    def _pair(self, channel: tuple[int, int], post: _Post) -> None:
        """Queue ``post`` on its channel and match it with the partner of the same index."""
        sends = self.sends.setdefault(channel, [])
        recvs = self.recvs.setdefault(channel, [])
        mine = sends if post.action.kind.is_send else recvs
        mine.append(post)
        k = len(mine) - 1
        if k >= len(sends) or k >= len(recvs):
            return
        s, r = sends[k], recvs[k]
        if s.payload != r.payload:
            raise ScheduleError(
                "p2p messages pair up wrongly", f"rank {s.rank} -> rank {r.rank}, message {k}",
                f"rank {s.rank} sends {_describe(s.payload)} ({s.action}) but rank {r.rank} "
                f"receives it as {_describe(r.payload)} ({r.action}); messages between two ranks "
                "match in posting order",
                "Order the sends and receives of each pair of ranks the same way")
        s.matched = r.matched = True
        s.done_at = r.done_at = max(s.at, r.at)
        self.ranks[r.rank].inbox.add(r.payload)
        self.messages += 1

    # -- reports ------------------------------------------------------------------------------

    def _error(self, st: _Rank, a: Action, why: str, fix: str) -> ScheduleError:
        stage = stage_of(st.rank, a.chunk, self.p)
        return ScheduleError(f"schedule step {a} is invalid",
                             f"rank {st.rank}, stage {stage}, step {st.pos}", why, fix)

    def _deadlock(self) -> ScheduleError:
        waits = []
        for st in self.ranks:
            if st.done:
                waits.append(f"rank {st.rank} finished")
                continue
            open_ = [str(post.action) for post in st.posted if not post.matched]
            waits.append(f"rank {st.rank} waits at step {st.pos} on {', '.join(open_)}")
        return ScheduleError("schedule deadlocks", f"p={self.p}, v={self.v}", "; ".join(waits),
                             "Reorder the actions so each blocked send meets its receive")

    def finish(self, m: int) -> CheckResult:
        for st in self.ranks:
            for c in range(self.v):
                for mb in range(m):
                    for kind in (Kind.F, Kind.B):
                        if (kind, mb, c) not in st.computed:
                            raise ScheduleError(
                                "schedule is incomplete",
                                f"rank {st.rank}, stage {stage_of(st.rank, c, self.p)}",
                                f"{kind.value} of microbatch {mb} (chunk {c}) never runs",
                                "Give every rank a forward and a backward per microbatch "
                                "and chunk")
        return CheckResult(tuple(st.max_in_flight for st in self.ranks), self.messages,
                           tuple(tuple(st.intervals) for st in self.ranks),
                           max(st.clock for st in self.ranks))


def _describe(payload: Payload) -> str:
    kind, mb, stage = payload
    what = "the activation" if kind == "act" else "the gradient"
    return f"{what} of microbatch {mb} for stage {stage}"


def _validate(actions: Sequence[Sequence[Action]], p: int, v: int) -> None:
    if len(actions) != p:
        raise ScheduleError("schedule has the wrong number of ranks", f"p={p}",
                            f"it has {len(actions)} action lists", "Give one list per rank")
    for r, lst in enumerate(actions):
        for i, a in enumerate(lst):
            bad = None
            if not 0 <= a.chunk < v:
                bad = f"chunk {a.chunk} is outside 0..{v - 1}"
            elif a.microbatch < 0:
                bad = "the microbatch index is negative"
            elif a.kind.is_comm and not (isinstance(a.peer, int) and 0 <= a.peer < p):
                bad = f"p2p peer {a.peer!r} is not a rank in 0..{p - 1}"
            elif not a.kind.is_comm and a.peer is not None:
                bad = "a compute action has a peer"
            if bad:
                raise ScheduleError(f"schedule step {a} is invalid", f"rank {r}, step {i}", bad,
                                    "Fix the action list")


def check_schedule(
    actions_per_rank: Sequence[Sequence[Action]], p: int, v: int = 1, *, m: int | None = None,
    cost_f: float = 1.0, cost_b: float = 2.0,
) -> CheckResult:
    """Simulate the schedule; raise `ScheduleError` on any fault, else return its peak
    in-flight activations per rank and its ideal timing. ``m`` defaults to one more than the
    largest microbatch in the lists."""
    _validate(actions_per_rank, p, v)
    if m is None:
        m = 1 + max((a.microbatch for lst in actions_per_rank for a in lst), default=-1)
    sim = _Sim(actions_per_rank, p, v, (cost_f, cost_b))
    sim.run()
    return sim.finish(m)
