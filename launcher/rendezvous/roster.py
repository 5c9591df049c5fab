"""Who joined a rendezvous, in what order, and who is turned away (pure).

Before the start the roster fills up to ``--nnodes`` agents. An agent is refused when it names a
node rank outside 0..N-1 or one already taken, when its host name is already here (two agents
on one host need --node-rank and distinct names), or when --include/--exclude leave its host
out. An agent whose connection closes before the start leaves its place free again.

At the start the order is fixed: an agent that gave --node-rank takes that place, the others
fill the free places in host-name order, numbers compared as numbers (node2 before node10): a
stable key, whatever order they arrived in. From
then on every place is a *seat*, and an agent that joins is refused unless a seat is vacant.

Restart hook: `Listener.vacate(node_rank)` (this roster's `vacate`, under the listener's lock)
frees the seat of a node a restart round gave up on; the next agent that joins (with that
--node-rank, or none) takes it (`Admission.seat`), and `Listener.replacements` hands its stream
over. Nothing vacates a seat yet, so after the start every agent is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from launcher import wire
from launcher.errors import HostfileError
from launcher.hosts.hostfile import LOCAL_NAMES
from launcher.hosts.names import validate_host_name
from launcher.hosts.selection import refusal


@dataclass(frozen=True)
class Arrival:
    """An agent that proved the token and asked to join."""

    host: str                 # its host name, as the ranks and the report will name it
    address: str              # the address it connected from (rank 0's route goes to it)
    node_rank: int | None     # --node-rank, when its starter assigns places; None: by name
    gpus: int | None          # GPUs `nvidia-smi` lists there; None where there is none

    def shown(self) -> str:
        return f"{self.host} ({self.address})"


class Unusable(Exception):
    """A JOIN the head cannot use at all (another protocol, a bad host name): ``why``, ``fix``."""

    def __init__(self, why: str, fix: str) -> None:
        super().__init__(why)
        self.why, self.fix = why, fix


def read_join(body: dict[str, Any], address: str) -> Arrival:
    """The Arrival a JOIN announces; Unusable says why it cannot join any job of this head."""
    if body.get("protocol") != wire.PROTOCOL_VERSION:
        raise Unusable(f"the agent speaks protocol {body.get('protocol')!r} (dtrain "
                       f"{body.get('dtrain')}), the head {wire.PROTOCOL_VERSION}",
                       "install the same dtrain version on every node")
    host, node_rank, gpus = body.get("host"), body.get("node_rank"), body.get("gpus")
    try:
        validate_host_name(host if isinstance(host, str) else "", f"agent at {address}")
    except HostfileError as exc:
        raise Unusable(str(exc), "give the node a plain host name") from None
    if str(host).lower() in LOCAL_NAMES:
        raise Unusable(f"its host name is {host}", "give every node a host name of its own")
    for name, value in (("node rank", node_rank), ("GPU count", gpus)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 0):
            raise Unusable(f"its {name} {value!r} is not a number", "check --node-rank")
    return Arrival(str(host), address, node_rank, gpus or None)


@dataclass(frozen=True)
class Admission:
    """The roster's answer to an arrival."""

    why: str = ""             # why it is refused; "" when admitted
    seat: int | None = None   # after the start: the vacated node rank it takes

    @property
    def admitted(self) -> bool:
        return not self.why


class Roster:
    def __init__(self, nnodes: int, *, include: str | None = None,
                 exclude: str | None = None) -> None:
        self.nnodes = nnodes
        self._include, self._exclude = include, exclude
        self._waiting: dict[str, Arrival] = {}  # by host name, lower case, before the start
        self.seats: list[Arrival] = []           # by node rank, from the start
        self._vacant: set[int] = set()

    @property
    def started(self) -> bool:
        return bool(self.seats)

    @property
    def complete(self) -> bool:
        return len(self._waiting) == self.nnodes

    @property
    def arrivals(self) -> list[Arrival]:
        """Who is here so far, in the order they came."""
        return list(self._waiting.values())

    def admit(self, arrival: Arrival) -> Admission:
        if self.started:
            return self._admit_to_seat(arrival)
        if self.complete:
            return Admission(f"the rendezvous already has its {self.nnodes} agents")
        if why := refusal(arrival.host, include=self._include, exclude=self._exclude):
            return Admission(why)
        same = self._waiting.get(arrival.host.lower())
        if same is not None:
            return Admission(f"an agent from host {same.shown()} already joined; give every "
                             "node its own host name")
        if arrival.node_rank is not None:
            if not 0 <= arrival.node_rank < self.nnodes:
                return Admission(f"node rank {arrival.node_rank} is outside 0..{self.nnodes - 1} "
                                 f"(--nnodes {self.nnodes})")
            taken = [a for a in self._waiting.values() if a.node_rank == arrival.node_rank]
            if taken:
                return Admission(f"node rank {arrival.node_rank} is taken by {taken[0].shown()}")
        self._waiting[arrival.host.lower()] = arrival
        return Admission()

    def leave(self, host: str) -> None:
        """An agent waiting for the start went away: its place is free again."""
        if not self.started:
            self._waiting.pop(host.lower(), None)

    def start(self) -> list[Arrival]:
        """Fix the order (node rank = index) and close the roster; needs it complete."""
        if not self.complete:
            raise ValueError(f"{len(self._waiting)} of {self.nnodes} agents; cannot start")
        places: list[Arrival | None] = [None] * self.nnodes
        for arrival in self._waiting.values():
            if arrival.node_rank is not None:
                places[arrival.node_rank] = arrival
        named = iter(sorted((a for a in self._waiting.values() if a.node_rank is None),
                            key=lambda a: _name_key(a.host)))
        self.seats = [place if place is not None else next(named) for place in places]
        self._waiting.clear()
        return list(self.seats)

    def vacate(self, node_rank: int) -> None:
        """The restart hook: free the seat of a node given up on, for an agent to take."""
        if not 0 <= node_rank < len(self.seats):
            raise ValueError(f"no seat {node_rank} among {len(self.seats)}")
        self._vacant.add(node_rank)

    def _admit_to_seat(self, arrival: Arrival) -> Admission:
        seats = sorted(self._vacant) if arrival.node_rank is None else (
            [arrival.node_rank] if arrival.node_rank in self._vacant else [])
        if not seats:
            return Admission(f"the job already started with {len(self.seats)} agents and no "
                             "seat is free; a late agent is not added")
        if why := refusal(arrival.host, include=self._include, exclude=self._exclude):
            return Admission(why)
        seated = [a for i, a in enumerate(self.seats) if i not in self._vacant
                  and a.host.lower() == arrival.host.lower()]
        if seated:
            return Admission(f"host {seated[0].shown()} already has a seat in the job")
        self._vacant.discard(seats[0])
        self.seats[seats[0]] = arrival
        return Admission(seat=seats[0])

    def missing(self, within: str) -> str:
        """How many came ``within`` the time, and from where: the rendezvous timeout's why."""
        came = ", ".join(a.shown() for a in self._waiting.values())
        return f"{len(self._waiting)} of {self.nnodes} agents joined {within}" + (
            f": {came}" if came else "")


def _name_key(host: str) -> list[tuple[int, int | str]]:
    """Host names in the order people number them: node2 before node10, pod-0-9 before
    pod-0-10 (numbers compare as numbers, the rest without case)."""
    return [(1, int(part)) if part.isdigit() else (0, part.lower())
            for part in re.split(r"(\d+)", host) if part]
