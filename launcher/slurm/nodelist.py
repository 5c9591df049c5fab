"""Slurm's compressed lists, expanded by dtrain itself (pure; no `scontrol` needed).

    SLURM_JOB_NODELIST   gpu[01-04,07],login2   ->  gpu01 gpu02 gpu03 gpu04 gpu07 login2
                         r[1-2]-n[3,5]           ->  r1-n3 r1-n5 r2-n3 r2-n5
    SLURM_TASKS_PER_NODE 4(x2),2                 ->  4 4 2

The rules are those of `scontrol show hostnames` (Slurm's hostlist.c), which the unit tests
compare against: names are separated by commas outside brackets; a bracket holds comma-separated
numbers and `lo-hi` ranges, zero-padded to the width of `lo`; several bracket groups expand as a
cartesian product, the leftmost varying slowest; text after the last bracket, an empty or
reversed range, and unbalanced brackets are refused. Parsing here rather than calling
`scontrol` keeps a launch free of one more process and of the Slurm client configuration.

A list is parsed and its names counted before any is built, so one over `MAX_NODES` (a typo,
or `a[1-3000]b[1-3000]`: nine million) is refused in microseconds; counts with repetitions
(`4(x99999999)`) are bounded the same way, and numbers have at most 18 digits.
"""

from __future__ import annotations

import itertools
import re

from launcher.errors import HostfileError

MAX_NODES = 65536  # a typo such as n[1-99999999] must not build a list of 10**8 names
_NUMBER = "[0-9]{1,18}"  # longer is no node number (and int() of 4,300+ digits raises)
_RANGE_RE = re.compile(rf"({_NUMBER})(?:-({_NUMBER}))?\Z")
_COUNT_RE = re.compile(rf"({_NUMBER})(?:\(x({_NUMBER})\))?\Z")


def expand_nodelist(text: str, where: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Every node name of a Slurm node list, in order (duplicates kept, as Slurm does). The
    list is parsed and counted first: nothing is built for a list over `MAX_NODES`."""
    texts = _split_top(text, where)
    tokens = [_parse_token(token, where) for token in texts]
    total = 0
    for token, (_, groups) in zip(texts, tokens, strict=True):
        total += _count(groups)
        if total > MAX_NODES:
            raise HostfileError("node list too long", where, f"more than {MAX_NODES} nodes "
                                f"(up to {token[:80]!r})", "check the list for a mistyped range")
    if not total:
        raise HostfileError("empty node list", where, f"{text!r} names no node",
                            "run inside an allocation (salloc/sbatch) or pass --hostfile")
    return [name for texts, groups in tokens for name in _names(texts, groups)]


def expand_counts(text: str, where: str) -> list[int]:
    """``4(x2),2`` -> [4, 4, 2]: SLURM_TASKS_PER_NODE / SLURM_JOB_CPUS_PER_NODE; refused
    before anything is built when it counts for more than `MAX_NODES` nodes."""
    parsed: list[tuple[int, int]] = []
    for part in text.split(","):
        match = _COUNT_RE.match(part.strip())
        if match is None:
            raise HostfileError("unreadable per-node counts", where, f"{text!r}",
                                "expected Slurm's form, e.g. 4(x2),2")
        parsed.append((int(match[1]), int(match[2] or 1)))
        if sum(times for _, times in parsed) > MAX_NODES:
            raise HostfileError("per-node counts too long", where, f"they count for more than "
                                f"{MAX_NODES} nodes", "check the repetitions (x...) in the list")
    return [count for count, times in parsed for _ in range(times)]


def _split_top(text: str, where: str) -> list[str]:
    """Split at commas outside brackets; refuse unbalanced or nested brackets."""
    tokens, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise HostfileError("unbalanced brackets in node list", where, f"{text!r}",
                                "check the list Slurm gave (scontrol show hostnames)")
        if char == "," and depth == 0:
            tokens.append(text[start:i])
            start = i + 1
    if depth:
        raise HostfileError("unbalanced brackets in node list", where, f"{text!r}",
                            "check the list Slurm gave (scontrol show hostnames)")
    tokens.append(text[start:])
    return [t.strip() for t in tokens if t.strip()]


#: A bracket group: its numbers as (text of lo, lo, hi) ranges, zero-padded to lo's width.
_Group = list[tuple[str, int, int]]


def _parse_token(token: str, where: str) -> tuple[list[str], list[_Group]]:
    """One name with zero or more bracket groups, ``a[1-2]b[08-10]``: its texts and groups."""
    parts = re.split(r"\[([^\]]*)\]", token)
    # parts alternates text, bracket body, text, ...; the last text must be empty (Slurm 22).
    if len(parts) > 1 and parts[-1]:
        raise HostfileError("unsupported node list", where, f"text {parts[-1]!r} follows the "
                            f"last bracket in {token!r}", "name nodes as prefix[range]")
    return parts[0::2], [_parse_group(body, token, where) for body in parts[1::2]]


def _parse_group(body: str, token: str, where: str) -> _Group:
    ranges: _Group = []
    for part in body.split(","):
        match = _RANGE_RE.match(part.strip())
        if match is None:
            raise HostfileError("bad range in node list", where, f"{part[:40]!r} in "
                                f"{token[:80]!r}", "use numbers and lo-hi ranges, e.g. "
                                "gpu[01-04,07]")
        low_text, high_text = match[1], match[2] or match[1]
        low, high = int(low_text), int(high_text)
        if high < low or high - low > MAX_NODES:
            raise HostfileError("bad range in node list", where, f"{part!r} in {token!r}",
                                "give lo-hi with lo <= hi")
        ranges.append((low_text, low, high))
    return ranges


def _count(groups: list[_Group]) -> int:
    """How many names the groups make, counted up to just past `MAX_NODES`."""
    total = 1
    for group in groups:
        total = min(total * sum(high - low + 1 for _, low, high in group), MAX_NODES + 1)
    return total


def _names(texts: list[str], groups: list[_Group]) -> list[str]:
    """The cartesian product of the groups, the leftmost varying slowest."""
    numbers = [[str(n).zfill(len(low_text)) for low_text, low, high in group
                for n in range(low, high + 1)] for group in groups]
    return ["".join(t + n for t, n in zip(texts, (*combo, ""), strict=True))
            for combo in itertools.product(*numbers)]
