"""The head's PMI service (`PmiRelay`: the key-value space of the round's hosts) and what it
tells the user about PMI: refused MPI features and stalled barriers.

Both are printed by the head, once: a refused feature (``MPI_Comm_spawn``, name publishing)
once per feature for the whole job, a stalled barrier once per ``--pmi-stall`` interval in one
line naming only the ranks it waits for. The head knows which hosts entered a barrier; which
ranks of a waiting host are missing only its agent knows, so when a report is due the head asks
the waiting hosts (``stall_query``) and prints when they have answered. A barrier no host has
entered yet at the head (one host, or every host partly in) is reported by the agents' own
clocks, relayed as they come.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from launcher.pmi.stall import StallClock, stall_text

UNSUPPORTED_FIX = ("dtrain's PMI-1 server starts every process up front and has no name "
                   "service; start all processes with `dtrain launch` (or use --launcher "
                   "mpirun with an MPI launcher that supports it)")


class PmiRelay:
    """PMI across the hosts of one round (numbered 0..n-1 in host order): the key-value space
    (`launcher.pmi.kvs`; none under --pmi off) and the notes. Made while the agents boot:
    between the last READY and START the import would delay every rank."""

    def __init__(self, *, hosts: int, kvsname: str, mode: str, stall_after: float,
                 say: Callable[[str], None]) -> None:
        self.kvs: Any = None
        if mode != "off":
            from launcher.pmi.kvs import KeyValueSpace

            self.kvs = KeyValueSpace(hosts=hosts, kvsname=kvsname)
        self.notes = PmiNotes(stall_after, say)

    def stall_queries(self, now: float, names: Sequence[str]) -> list[int]:
        """The hosts to ask which of their ranks hold a long-stalled barrier up."""
        if self.kvs is None:
            return []
        waiting = {h: names[h] for h in self.kvs.waiting_hosts()}
        return self.notes.tick(now, waiting, self.kvs.epoch)

    def handle(self, host: int, name: str, msg: Mapping[str, Any]
               ) -> list[tuple[int, dict[str, Any]]]:
        """A PMI message of host ``host`` (``name``) but abort and rank_failed (failures, the
        supervisor's); returns the replies, each to its host."""
        op = msg.get("op")
        if op == "stall":
            self.notes.agent_stall(name, msg, bool(self.kvs and self.kvs.waiting_hosts()))
        elif op == "stall_state":
            self.notes.answer(host, msg)
        elif op == "unsupported":
            self.notes.unsupported(msg.get("rank"), name, str(msg.get("feature")))
        elif self.kvs is not None:
            return list(self.kvs.handle(host, dict(msg)))
        return []


class PmiNotes:
    def __init__(self, stall_after: float, say: Callable[[str], None]) -> None:
        self._clock = StallClock(stall_after)
        self._say = say
        self._features: set[str] = set()
        self._asked: dict[int, str] = {}     # host index -> name, still to answer
        self._answers: list[Mapping[str, Any]] = []
        self._waited = 0.0

    def unsupported(self, rank: object, host: str, feature: str) -> None:
        if feature not in self._features:
            self._features.add(feature)
            self._say(f"rank {rank}@{host} called {feature}, which dtrain's PMI does not "
                      f"support: the call fails in the rank. {UNSUPPORTED_FIX}")

    def tick(self, now: float, waiting: Mapping[int, str], epoch: int) -> list[int]:
        """``waiting``: hosts (index -> name) the head's barrier waits for. Returns the hosts
        to send a ``stall_query`` to, when a report is due."""
        waited = self._clock.due(now, epoch if waiting else None)
        if waited is None:
            return []
        if self._asked:  # the previous round never completed: say what it learnt
            self._report(list(self._asked.values()))
        self._asked, self._answers, self._waited = dict(waiting), [], waited
        return list(waiting)

    def answer(self, host: int, msg: Mapping[str, Any]) -> None:
        """A host's ``stall_state``: its ranks that hold the barrier up."""
        name = self._asked.pop(host, None)
        if name is None:
            return
        self._answers.append({**msg, "host": name})
        if not self._asked:
            self._report([])

    def agent_stall(self, host: str, msg: Mapping[str, Any], head_waiting: bool) -> None:
        """An agent's own report of a local barrier; the head's report covers it when the
        head's barrier is waiting too."""
        if not head_waiting:
            self._say(stall_text(float(msg.get("seconds", 0)), _pairs(msg, "ranks", host),
                                 _pairs(msg, "gone", host)))

    def _report(self, silent: Sequence[str]) -> None:
        missing = [p for m in self._answers for p in _pairs(m, "ranks", m["host"])]
        gone = [p for m in self._answers for p in _pairs(m, "gone", m["host"])]
        self._say(stall_text(self._waited, sorted(missing), sorted(gone), silent))
        self._asked, self._answers = {}, []


def _pairs(msg: Mapping[str, Any], key: str, host: str) -> list[tuple[int, str]]:
    return [(int(rank), host) for rank in msg.get(key, [])]
