"""The head's PMI-1 key-value space: one per job, fed by the per-host proxies.

Pure: the supervisor passes each PMI relay message from host ``h`` to ``handle(h, msg)`` and
sends the returned ``(host, reply)`` pairs. The messages are those of ``launcher.pmi.proxy``.

A barrier is complete when every host sent ``barrier_in`` (each proxy sends one only after all
of its ranks entered); the head then sends every host one ``barrier_out``, so a barrier costs
2 x hosts messages whatever the number of ranks. What the answer carries depends on the size
of the epoch's cards:

* when the cards times the hosts they would go to weigh at most ``push_bytes``
  (`PUSH_BYTES`): every key put in that epoch (``kv``), and each proxy answers the gets that
  follow from its own cache;
* above it, none (``"kv": {}``) but their size (``"held": bytes``): pushing every card to
  every host is hosts x cards, N^2 bytes in all, while a rank asks for the cards of the peers
  it wires up to. A host's get then travels up to the nearest level that has the key (its own
  cache, each relay's subtree, this space) - PMIx's "direct modex" - and a host whose ranks
  ask for much of it fetches the whole store in one ``fetch`` (`launcher.pmi.proxy`), as
  MPICH's default address exchange does (every host reads every card once).

Keys stay committed for the job: a ``get`` or ``fetch`` is answered from every completed
epoch. A fetch's answer names no request (a host has one fetch under way at most): between two
fences it is the same for every host, so it is encoded once and the same bytes go to each.

Under fan-out (`launcher.tree.fence`) one ``barrier_in`` may cover many hosts (``hosts``, the
host indices it stands for): it is answered with one ``barrier_out`` naming the same hosts, so
the head sends one message per message it got, K per fence for K relays.

Conflicting puts: MPICH never puts the same key twice with different values, so the last
writer wins (hosts are merged in arrival order) and the key is recorded in ``conflicts`` for a
diagnosis rather than failing the job.
"""

from __future__ import annotations

from collections.abc import Mapping

from launcher.errors import PmiError

#: The most bytes a fence's answer may carry in all: an epoch's cards (keys and values) times the
#: hosts it goes to. MPICH's default address exchange reads every card (10 keys, 6.6 KB a rank
#: of the MPICH the benches run), so its hosts fetch the whole store at their first miss anyway
#: (`launcher.pmi.proxy`): pushing it spares them that round trip for the same bytes, and
#: wastes at most this much where ranks wire up lazily. 32 MiB is 64 hosts of that MPICH
#: (27 MB; a quarter of a second on a 1 Gb/s link, the head's own share of the fence), but only
#: 32 KiB of cards at 1,024 hosts, whose N^2 bytes no link could carry.
PUSH_BYTES = 32 * 1024 * 1024

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from typing import Any

    from launcher.pmi.actions import Message


class KeyValueSpace:
    """The job's committed keys plus the epoch being gathered; see the module docstring."""

    def __init__(self, *, hosts: int, kvsname: str, push_bytes: int = PUSH_BYTES) -> None:
        if hosts < 1:
            raise ValueError("a key-value space needs at least one host")
        self.hosts, self.kvsname, self.push_bytes = hosts, kvsname, push_bytes
        self.epoch = 0                          # completed barriers
        self.conflicts: list[str] = []          # keys put twice with different values
        self._store: dict[str, str] = {}        # committed by completed barriers
        self._epoch_puts: dict[str, str] = {}
        self._entered: set[int] = set()
        self._reporters: dict[int, list[int]] = {}  # who sent a barrier_in -> hosts it covers
        self._aborted: tuple[int, int, str] | None = None

    @property
    def aborted(self) -> tuple[int, int, str] | None:
        """``(rank, code, message)`` of the first abort, or None."""
        return self._aborted

    def handle(self, host: int, msg: Mapping[str, Any]) -> list[tuple[int, Message]]:
        """One relay message from ``host``; returns the ``(host, reply)`` pairs to send."""
        if not 0 <= host < self.hosts:
            raise _error(f"host index {host} outside 0..{self.hosts - 1}")
        op = msg.get("op")
        if op == "barrier_in":
            return self._barrier_in(host, msg.get("puts"), msg.get("hosts", [host]))
        if op == "get":
            return [(host, self._get(msg))]
        if op == "fetch":  # every committed card, for a host whose ranks read much of them
            return [(host, {"op": "cards", "kv": self._store})]
        if op == "abort":
            self._abort(msg)
            return []
        raise _error(f"unknown op {op!r} from host {host}")

    def waiting_hosts(self) -> list[int]:
        """Hosts that have not entered the current barrier (empty when none is under way)."""
        if not self._entered:
            return []
        return [h for h in range(self.hosts) if h not in self._entered]

    def get(self, key: str) -> str | None:
        """A committed value (for tests and diagnosis)."""
        return self._store.get(key)

    def _barrier_in(self, host: int, puts: object, hosts: object) -> list[tuple[int, Message]]:
        if not isinstance(puts, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in puts.items()):
            raise _error(f"barrier_in from host {host} without a string-to-string puts object")
        if not isinstance(hosts, list) or not all(
                isinstance(h, int) and 0 <= h < self.hosts for h in hosts):
            raise _error(f"barrier_in from host {host} covers hosts outside the job: {hosts}")
        if twice := self._entered.intersection(hosts):
            raise _error(f"host {min(twice)} entered barrier {self.epoch} twice")
        self._merge(puts)
        self._entered.update(hosts)
        self._reporters[host] = list(hosts)
        if len(self._entered) < self.hosts:
            return []
        kv, self._epoch_puts = self._epoch_puts, {}
        self._store.update(kv)
        self._entered.clear()
        self.epoch += 1
        reporters, self._reporters = self._reporters, {}
        size = sum(len(k) + len(v) for k, v in kv.items())
        answer: dict[str, Any] = {"op": "barrier_out", "kv": kv}
        if size * self.hosts > self.push_bytes:  # announced, not sent: gets find the keys
            answer = {"op": "barrier_out", "kv": {}, "held": size}
        return [(h, answer if covered == [h] else {**answer, "hosts": covered})
                for h, covered in sorted(reporters.items())]

    def _merge(self, puts: Mapping[str, str]) -> None:
        for key, value in puts.items():
            old = self._epoch_puts.get(key, self._store.get(key))
            if old is not None and old != value:
                self.conflicts.append(key)
            self._epoch_puts[key] = value

    def _get(self, msg: Mapping[str, Any]) -> Message:
        key, req = msg.get("key"), msg.get("req")
        value = self._store.get(key) if isinstance(key, str) else None
        return {"op": "get_result", "req": req, "found": value is not None,
                "value": value or ""}

    def _abort(self, msg: Mapping[str, Any]) -> None:
        if self._aborted is None:
            self._aborted = (int(msg.get("rank", -1)), int(msg.get("code", 1)),
                             str(msg.get("message", "")))


def _error(why: str) -> PmiError:
    return PmiError("PMI relay message rejected", "head", why,
                    "This is a bug in dtrain; please report it with the agent log")
