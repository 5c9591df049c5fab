"""The PMI fence inside the tree (pure): each relay merges its subtree's barriers into one.

Flat, every host sends the head one ``barrier_in`` per fence and the head sends every host one
``barrier_out`` with all the cards: 2 x hosts messages at the head. In the tree a relay holds
back the ``barrier_in`` of its own agent and of each child (a child relay's already covers its
subtree), and once every host of its subtree that takes part has entered, sends one upwards:

    -> {"op": "barrier_in", "puts": {merged}, "hosts": [every host it covers]}
    <- {"op": "barrier_out", "kv": {...}, "hosts": [the same hosts]}

The head answers each such message once (`launcher.pmi.kvs`), and the relay hands the answer
down: its own agent gets a plain ``barrier_out``, a child one for the hosts below it (plain when
that is the child alone). So the head sends one message per host it started, K, per fence.
Each relay keeps the cards it passed down, and once the fence is answered its subtree's own
(those it merged on the way up, whether or not the answer carried them back), and answers a
``get`` from below that it holds: a get is served by the nearest level that has the key.
A ``fetch`` (every card, `launcher.pmi.proxy`) goes up once per relay and fence: the first one
from below goes on, later ones wait, and all are answered when the cards pass down, with the
frame that carries them as it came (a fetch's answer names no request: `launcher.pmi.kvs`);
until the next fence, that same frame answers every fetch at once.

Which hosts take part is read from the SPECs the relay passes down (a host with ranks and PMI
on, per key-value space name: a later round is a new name, and a fresh fence).
"""

from __future__ import annotations

from collections.abc import Mapping

from launcher.pmi.actions import push_and_release

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from typing import Any


class SubtreeFence:
    """One relay's view: ``route`` maps every host of its subtree to the next hop towards it
    (the relay itself maps to itself)."""

    def __init__(self, own: int, route: Mapping[int, int]) -> None:
        self.own, self.route = own, dict(route)
        self._spec: dict[int, tuple[str, bool]] = {}    # host -> (kvsname, takes part)
        self._entered: dict[str, set[int]] = {}
        self._puts: dict[str, dict[str, str]] = {}
        self._cards: dict[str, dict[str, str]] = {}     # kvsname -> cards it can serve
        self._merged: dict[str, dict[str, str]] = {}    # the subtree's puts, sent up
        self._fences: dict[str, int] = {}               # kvsname -> fences answered
        self._whole: dict[str, int] = {}                # ... when every card last passed
        self._frame: dict[str, bytes] = {}              # ... and the frame that carried them
        # kvsname -> (the host whose fetch went up, the hosts waiting for its cards)
        self._fetching: dict[str, tuple[int, list[int]]] = {}

    def spec(self, host: int, body: Mapping[str, Any]) -> None:
        """A SPEC for ``host`` passed through (or the relay's own)."""
        pmi = body.get("pmi") or {}
        kvsname = str(pmi.get("kvsname", ""))
        self._spec[host] = (kvsname, bool(body.get("ranks")) and pmi.get("mode") != "off")

    def enter(self, host: int, msg: Mapping[str, Any]) -> dict[str, Any] | None:
        """``barrier_in`` from ``host`` (covering ``msg["hosts"]`` when it aggregates); the
        message to send upwards once the subtree's fence is complete, else None."""
        kvsname = self._spec.get(host, ("", False))[0]
        covered = [int(h) for h in msg.get("hosts", [host])]
        entered = self._entered.setdefault(kvsname, set())
        entered.update(covered)
        self._puts.setdefault(kvsname, {}).update(msg.get("puts") or {})
        members = {h for h, (name, part) in self._spec.items() if part and name == kvsname}
        if not members <= entered:
            return None
        puts = self._puts.pop(kvsname)
        self._entered.pop(kvsname)
        self._merged.setdefault(kvsname, {}).update(puts)
        return {"op": "barrier_in", "puts": puts, "hosts": sorted(entered)}

    def out(self, msg: Mapping[str, Any]) -> list[tuple[int, dict[str, Any]]]:
        """The head's answer for the hosts this relay covered: ``(next hop, message)`` pairs in
        the order to send them, one per relay below and a push and a release per host (the hop
        is ``own`` for the relay's own agent)."""
        hosts = [int(h) for h in msg.get("hosts", [self.own])]
        kv = dict(msg.get("kv") or {})
        if hosts:
            kvsname = self._kvsname(hosts[0])
            cards = self._cards.setdefault(kvsname, {})
            cards.update(self._merged.pop(kvsname, {}))
            cards.update(kv)
            self._fences[kvsname] = self._fences.get(kvsname, 0) + 1
        groups: dict[int, list[int]] = {}
        for h in hosts:
            groups.setdefault(self.route.get(h, h), []).append(h)
        out, releases = [], []
        for hop, group in groups.items():
            body: dict[str, Any] = {"op": "barrier_out", "kv": kv}
            if msg.get("held"):  # the cards were left above (`launcher.pmi.kvs`)
                body["held"] = msg["held"]
            if group != [hop]:
                body["hosts"] = group
                out.append((hop, body))
            else:  # every host's cards before any host's release, as at the head
                push, release = push_and_release(body)
                if push is not None:
                    out.append((hop, push))
                releases.append((hop, release))
        return out + releases

    def get(self, host: int, key: object) -> str | None:
        """A card this relay holds, for a ``get`` from ``host``; None: ask upwards."""
        cards = self._cards.get(self._kvsname(host), {})
        return cards.get(key) if isinstance(key, str) else None

    def fetch(self, host: int) -> bytes | None:
        """A ``fetch`` from ``host``: the frame of every card when this relay passed it down
        since the last fence; else None (then `fetch_waits`)."""
        kvsname = self._kvsname(host)
        if self._whole.get(kvsname, -1) == self._fences.get(kvsname, 0):
            return self._frame[kvsname]
        return None

    def fetch_waits(self, host: int) -> bool:
        """After `fetch` said None: True if a fetch from below is already on its way up (this
        one waits for its cards), False if this one is the first (it goes up)."""
        kvsname = self._kvsname(host)
        if kvsname in self._fetching:
            self._fetching[kvsname][1].append(host)
            return True
        self._fetching[kvsname] = (host, [])
        return False

    def cards_passing(self, host: int, frame: bytes) -> list[int]:
        """The ``frame`` of every card, passing down to ``host``: kept to answer later
        fetches; when it answers the fetch this relay sent up (that host's: a host has one
        under way at most), the hosts whose fetches waited for it, to send it to as well."""
        kvsname = self._kvsname(host)
        self._whole[kvsname] = self._fences.get(kvsname, 0)
        self._frame[kvsname] = frame
        first, waiting = self._fetching.get(kvsname, (None, []))
        if first != host:
            return []
        del self._fetching[kvsname]
        return waiting

    def cards(self, host: int, kv: Mapping[str, str]) -> None:
        """The cards of that frame, decoded: kept for the gets from below."""
        self._cards.setdefault(self._kvsname(host), {}).update(kv)

    def _kvsname(self, host: int) -> str:
        return self._spec.get(host, ("", False))[0]


def flatten(node: dict[str, Any]) -> list[dict[str, Any]]:
    """A SUBTREE body's ``node`` and every node below it, depth first in order (the hosts a
    relay's fence routes to through that child)."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(reversed(n["children"]))
    return out
