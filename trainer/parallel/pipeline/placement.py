"""Where the p2p actions of a schedule go: turn per-rank compute slots into full action lists.

A builder in `trainer.parallel.pipeline.schedule` decides only the order of compute on each rank, as
*slots* (one or more F/B actions run back to back). Between two slots, at a *gap*, a rank posts
one batch of p2p actions (``Communicator.batch_p2p``) and waits for all of it:

* the sends of everything the slot before produced (activations first, then gradients);
* the receives of everything the slot after consumes.

Two rules keep that batch from deadlocking or mixing messages up:

* **FIFO per pair of ranks.** Messages between two ranks match in posting order (MPI with one
  tag, NCCL), so a rank receives from a peer strictly in the order the peer sends to it: to get
  the message it needs, it also receives every earlier one from that peer (kept until used).
* **Receive early only to break a wait cycle.** The placement replays the ranks' gaps under
  rendezvous semantics (a send completes once its receive is posted). Receives are posted as late
  as possible, right before the slot that uses them; only when every rank is stuck does a rank
  that is waiting anyway also take the messages already sent to it. Interleaved 1F1B with a
  microbatch group larger than p needs this on the ring's wrap-around (rank p-1 to rank 0),
  where Megatron's ``recv_tensor_from_previous_stage`` does the same.

The result is checked independently by `trainer.parallel.pipeline.check.check_schedule`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from trainer.parallel.pipeline.actions import Action, Kind, ScheduleError, place, stage_of

Message = tuple[Kind, int, int]  # (SEND_F | SEND_B, microbatch, sender's chunk)


@dataclass
class _Rank:
    rank: int
    slots: Sequence[Sequence[Action]]
    out: list[Action] = field(default_factory=list)
    gap: int = 0
    batch: list[Action] | None = None  # the batch posted at the current gap, while it waits

    @property
    def done(self) -> bool:
        return self.gap > len(self.slots)


def sends_of(rank: int, slot: Sequence[Action], p: int, v: int) -> list[Action]:
    """The sends that follow ``slot``: its activations (F direction) first, then gradients."""
    out = []
    for a in slot:
        s = stage_of(rank, a.chunk, p)
        if a.kind is Kind.F and s < v * p - 1:
            out.append(Action(Kind.SEND_F, a.microbatch, a.chunk, place(s + 1, p)[0]))
    for a in slot:
        s = stage_of(rank, a.chunk, p)
        if a.kind is Kind.B and s > 0:
            out.append(Action(Kind.SEND_B, a.microbatch, a.chunk, place(s - 1, p)[0]))
    return out


def _as_recv(send: Action, sender: int, p: int) -> Action:
    """The receive on the peer that matches ``send`` from ``sender``."""
    s = stage_of(sender, send.chunk, p)
    if send.kind is Kind.SEND_F:
        return Action(Kind.RECV_F, send.microbatch, place(s + 1, p)[1], sender)
    return Action(Kind.RECV_B, send.microbatch, place(s - 1, p)[1], sender)


class _Placer:
    def __init__(self, slots: Sequence[Sequence[Sequence[Action]]], p: int, v: int) -> None:
        self.p, self.v = p, v
        self.ranks = [_Rank(r, s) for r, s in enumerate(slots)]
        # Every message of each (sender, receiver) pair in the sender's order, as the receive
        # it becomes; `taken` counts how many of them the receiver has posted, `sent` how many
        # the sender has posted.
        self.stream: dict[tuple[int, int], list[Action]] = {}
        for st in self.ranks:
            for slot in st.slots:
                for send in sends_of(st.rank, slot, p, v):
                    self.stream.setdefault(send.channel(st.rank), []).append(
                        _as_recv(send, st.rank, p))
        self.taken = dict.fromkeys(self.stream, 0)
        self.sent = dict.fromkeys(self.stream, 0)

    def run(self) -> list[list[Action]]:
        while not all(st.done for st in self.ranks):
            moved = False
            for st in self.ranks:
                while self._advance(st):
                    moved = True
            if not moved and not self._receive_early():
                raise ScheduleError(
                    "cannot place the p2p actions of this schedule", f"p={self.p}, v={self.v}",
                    "the compute order leaves a cycle of ranks each waiting for the next",
                    "Check the compute order of every rank (warm-up length, slot order)")
        return [st.out for st in self.ranks]

    def _advance(self, st: _Rank) -> bool:
        if st.done:
            return False
        if st.batch is None:
            self._post(st)
            return True
        if not self._complete(st):
            return False
        st.out += st.batch
        st.batch = None
        if st.gap < len(st.slots):
            st.out += list(st.slots[st.gap])
        st.gap += 1
        return True

    def _post(self, st: _Rank) -> None:
        batch = []
        if st.gap > 0:
            for send in sends_of(st.rank, st.slots[st.gap - 1], self.p, self.v):
                batch.append(send)
                self.sent[send.channel(st.rank)] += 1
        if st.gap < len(st.slots):
            for need in _needs(st.rank, st.slots[st.gap], self.p, self.v):
                batch += self._take_through(st.rank, need)
        st.batch = batch

    def _take_through(self, rank: int, need: Action) -> list[Action]:
        """Receives from ``need.peer`` up to and including ``need`` (FIFO), unless taken."""
        key = need.channel(rank)
        stream = self.stream.get(key, [])
        if need in stream[: self.taken.get(key, 0)]:
            return []
        if need not in stream:
            raise ScheduleError("schedule needs a message nobody sends", f"rank {rank}",
                                f"{need} has no matching send on rank {need.peer}",
                                "Give every stage's input a producer")
        end = stream.index(need) + 1
        got = stream[self.taken[key]:end]
        self.taken[key] = end
        return got

    def _complete(self, st: _Rank) -> bool:
        for a in st.batch or []:
            key = a.channel(st.rank)
            if a.kind.is_send and self.taken[key] < self.sent[key]:
                return False
            if not a.kind.is_send and self.sent[key] < self.taken[key]:
                return False
        return True

    def _receive_early(self) -> bool:
        """Every rank is stuck: ranks that wait at a gap take what was already sent to them."""
        took = False
        for st in self.ranks:
            if st.batch is None:
                continue
            for (src, dst), stream in self.stream.items():
                if dst == st.rank and self.taken[(src, dst)] < self.sent[(src, dst)]:
                    st.batch += stream[self.taken[(src, dst)]:self.sent[(src, dst)]]
                    self.taken[(src, dst)] = self.sent[(src, dst)]
                    took = True
        return took


def _needs(rank: int, slot: Sequence[Action], p: int, v: int) -> list[Action]:
    """The receives ``slot`` consumes, activations first."""
    fwd, bwd = [], []
    for a in slot:
        s = stage_of(rank, a.chunk, p)
        if a.kind is Kind.F and s > 0:
            fwd.append(Action(Kind.RECV_F, a.microbatch, a.chunk, place(s - 1, p)[0]))
        if a.kind is Kind.B and s < v * p - 1:
            bwd.append(Action(Kind.RECV_B, a.microbatch, a.chunk, place(s + 1, p)[0]))
    return fwd + bwd


def place_p2p(slots_per_rank: Sequence[Sequence[Sequence[Action]]], p: int, v: int
              ) -> list[list[Action]]:
    """Full action lists (compute and p2p) from each rank's compute slots."""
    return _Placer(slots_per_rank, p, v).run()
