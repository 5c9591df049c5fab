"""Which hosts and which slots (GPUs) of them a job uses: DeepSpeed's selection semantics.

    --include / --exclude   NODE_SPEC[@NODE_SPEC...], NODE_SPEC = NAME[:SLOT[,SLOT...]]
                            e.g. `node1:0,1@node2`; mutually exclusive. A bare NAME means the
                            whole host; NAME:SLOTS chooses (or removes) those slots only.
    --num-nodes N           keep the first N hosts that remain, in hostfile order.
    --nproc-per-node N      keep the first N remaining slots of every host.

The steps apply in that order: filter, then --num-nodes, then --nproc-per-node. DeepSpeed
refuses to combine its --num_gpus with a filter; dtrain allows it because the order is fixed.
--nproc-per-node never oversubscribes: a host with fewer than N slots left is an error that names
the host and its hostfile line (raise its slots= or lower N), since silently starting more ranks
than GPUs would put two ranks on one GPU.

Host order is always the hostfile's, whatever the order in a filter, because rank order follows
it. Filter names match host names case-insensitively (DNS names are), and IPv6 literals are
written in brackets: `[fe80::1]:0,1`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from launcher.errors import UsageError, listed
from launcher.hosts.hostfile import HostEntry

_DIGITS_RE = re.compile(r"[0-9]+\Z")
_MAX_LISTED = 12  # known hosts shown in an "unknown host" message


@dataclass(frozen=True)
class HostSlots:
    """A host of the job and the slots (GPU indices) its ranks use, in order."""

    entry: HostEntry
    slots: tuple[int, ...]   # the slot (GPU) indices used on this host, in order
    restricted: bool         # True when a filter chose specific slots -> CUDA_VISIBLE_DEVICES


# A parsed filter: host name (lower case) -> chosen slots, or None for the whole host.
Filter = Mapping[str, "frozenset[int] | None"]


def select_hosts(entries: list[HostEntry], *, include: str | None = None,
                 exclude: str | None = None, num_nodes: int | None = None,
                 nproc_per_node: int | None = None, unknown_ok: bool = False) -> list[HostSlots]:
    """Apply the filters to the hostfile's entries; the result is never empty. With
    ``unknown_ok`` a filter may name hosts that are not there (agents that joined by rendezvous
    are whoever came: `refusal` turned the others away)."""
    if include is not None and exclude is not None:
        raise UsageError("conflicting options", "--include/--exclude", "they are mutually "
                         "exclusive", "Give only one of them")
    pool = [HostSlots(e, tuple(range(e.slots)), False) for e in entries]
    if include is not None:
        pool = _include(pool, parse_filter(include, "--include", entries, unknown_ok))
    elif exclude is not None:
        pool = _exclude(pool, parse_filter(exclude, "--exclude", entries, unknown_ok))
    if not pool:
        option = "--include" if include is not None else "--exclude" if exclude is not None \
            else "hosts"
        raise UsageError("no hosts left", option, "the selection removed every slot",
                         "Keep at least one host and slot")
    if num_nodes is not None:
        pool = _first_nodes(pool, num_nodes)
    if nproc_per_node is not None:
        pool = _first_slots(pool, nproc_per_node)
    return pool


def parse_filter(text: str, option: str, entries: list[HostEntry], unknown_ok: bool = False
                 ) -> dict[str, frozenset[int] | None]:
    """Parse `NODE_SPEC[@NODE_SPEC...]` against the known hosts; names are checked here."""
    by_name = {e.name.lower(): e for e in entries}
    chosen: dict[str, frozenset[int] | None] = {}
    for name, slots in filter_specs(text, option):
        entry = by_name.get(name.lower())
        if entry is None:
            if unknown_ok:
                continue
            raise UsageError("unknown host in filter", option, f"{name!r} is not in the host "
                             f"list; known hosts: {_known(entries)}",
                             "Use a name exactly as the hostfile writes it")
        _check_range(entry, slots, option)
        key = entry.name.lower()
        if key in chosen:  # repeated host: union of slots; a bare name means all of them
            old = chosen[key]
            slots = None if old is None or slots is None else old | slots
        chosen[key] = slots
    return chosen


def filter_specs(text: str, option: str) -> list[tuple[str, frozenset[int] | None]]:
    """The (host name, slots or None for all) pairs of a filter, as written."""
    if not text.strip():
        raise UsageError("empty host filter", option, "no NODE_SPEC was given",
                         "Write e.g. node1:0,1@node2")
    return [_split_spec(spec.strip(), option) for spec in text.split("@")]


def refusal(name: str, *, include: str | None, exclude: str | None) -> str:
    """Why a host that comes by itself (a rendezvous agent) is not used, "" when it is:
    --include does not name it, or --exclude names all of it (slots are chosen later)."""
    option, text = ("--include", include) if include is not None else ("--exclude", exclude)
    if text is None:
        return ""
    named = {n.lower(): slots for n, slots in filter_specs(text, option)}
    if include is not None and name.lower() not in named:
        return f"--include does not name {name}"
    if exclude is not None and name.lower() in named and named[name.lower()] is None:
        return f"--exclude leaves {name} out"
    return ""


def _split_spec(spec: str, option: str) -> tuple[str, frozenset[int] | None]:
    if not spec:
        raise UsageError("empty host in filter", option, "two '@' in a row, or one at an end",
                         "Separate NODE_SPECs with a single '@'")
    if spec.startswith("["):  # [v6addr] or [v6addr]:slots
        name, _, rest = spec[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise UsageError("bad host filter", option, f"{spec!r} has text after ']'",
                             "Write [addr] or [addr]:0,1")
        slot_text = rest[1:] if rest else None
    else:
        name, colon, slot_text = spec.partition(":")
        slot_text = slot_text if colon else None
    if slot_text is None:
        return name, None
    slots = set()
    for item in slot_text.split(","):
        if not _DIGITS_RE.match(item.strip()):
            raise UsageError("bad slot in filter", option, f"{item!r} in {spec!r} is not a "
                             "slot index", "Write slot indices as numbers: node1:0,1")
        slots.add(int(item))
    return name, frozenset(slots)


def _check_range(entry: HostEntry, slots: frozenset[int] | None, option: str) -> None:
    for slot in sorted(slots or ()):
        if slot >= entry.slots:
            raise UsageError("slot out of range", f"{option} {entry.name}:{slot}",
                             f"{entry.name} has {entry.slots} slot(s), 0..{entry.slots - 1} "
                             f"({entry.source or 'host list'})",
                             "Choose existing slots, or raise slots= in the hostfile")


def _include(pool: list[HostSlots], chosen: Filter) -> list[HostSlots]:
    kept = []
    for host in pool:
        key = host.entry.name.lower()
        if key not in chosen:
            continue
        slots = chosen[key]
        if slots is None:
            kept.append(host)
        else:
            kept.append(HostSlots(host.entry, tuple(sorted(slots)), True))
    return kept


def _exclude(pool: list[HostSlots], removed: Filter) -> list[HostSlots]:
    kept = []
    for host in pool:
        key = host.entry.name.lower()
        if key not in removed:
            kept.append(host)
            continue
        gone = removed[key]
        if gone is None:
            continue
        left = tuple(s for s in host.slots if s not in gone)
        if left:
            kept.append(HostSlots(host.entry, left, True))
    return kept


def _first_nodes(pool: list[HostSlots], num_nodes: int) -> list[HostSlots]:
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise UsageError("bad node count", "--num-nodes", f"{num_nodes!r} is not a positive "
                         "number", "Give at least 1")
    if num_nodes > len(pool):
        raise UsageError("not enough hosts", f"--num-nodes {num_nodes}", f"only {len(pool)} "
                         "host(s) are available after filtering",
                         "Add hosts to the hostfile or lower --num-nodes")
    return pool[:num_nodes]


def _first_slots(pool: list[HostSlots], nproc: int) -> list[HostSlots]:
    if not isinstance(nproc, int) or nproc < 1:
        raise UsageError("bad rank count", "--nproc-per-node", f"{nproc!r} is not a positive "
                         "number", "Give at least 1")
    for host in pool:
        if len(host.slots) < nproc:
            raise UsageError("not enough slots", f"--nproc-per-node {nproc}",
                             f"{host.entry.name} has {len(host.slots)} usable slot(s) "
                             f"({host.entry.source or 'host list'})",
                             "Raise its slots= in the hostfile or lower --nproc-per-node")
    return [replace(host, slots=host.slots[:nproc]) for host in pool]


def _known(entries: list[HostEntry]) -> str:
    return listed([e.name for e in entries], _MAX_LISTED)
