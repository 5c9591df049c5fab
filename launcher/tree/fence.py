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
Each relay keeps the cards it passed down and answers a ``get`` from below that it holds: a
get is served by the nearest level that has the key.

Which hosts take part is read from the SPECs the relay passes down (a host with ranks and PMI
on, per key-value space name: a later round is a new name, and a fresh fence).
"""

from __future__ import annotations

from collections.abc import Mapping

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
        self._cards: dict[str, dict[str, str]] = {}     # kvsname -> cards passed down

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
        return {"op": "barrier_in", "puts": puts, "hosts": sorted(entered)}

    def out(self, msg: Mapping[str, Any]) -> list[tuple[int, dict[str, Any]]]:
        """The head's answer for the hosts this relay covered: ``(next hop, message)`` pairs,
        one per hop; the hop is ``own`` for the relay's own agent."""
        hosts = [int(h) for h in msg.get("hosts", [self.own])]
        kv = dict(msg.get("kv") or {})
        if hosts:
            self._cards.setdefault(self._spec.get(hosts[0], ("", False))[0], {}).update(kv)
        groups: dict[int, list[int]] = {}
        for h in hosts:
            groups.setdefault(self.route.get(h, h), []).append(h)
        out = []
        for hop, group in groups.items():
            body: dict[str, Any] = {"op": "barrier_out", "kv": kv}
            if group != [hop]:
                body["hosts"] = group
            out.append((hop, body))
        return out

    def get(self, host: int, key: object) -> str | None:
        """A card this relay passed down, for a ``get`` from ``host``; None: ask upwards."""
        cards = self._cards.get(self._spec.get(host, ("", False))[0], {})
        return cards.get(key) if isinstance(key, str) else None
