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
"""

from __future__ import annotations

import itertools
import re

from launcher.errors import HostfileError

MAX_NODES = 65536  # a typo such as n[1-99999999] must not build a list of 10**8 names
_RANGE_RE = re.compile(r"([0-9]+)(?:-([0-9]+))?\Z")
_COUNT_RE = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?\Z")


def expand_nodelist(text: str, where: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Every node name of a Slurm node list, in order (duplicates kept, as Slurm does)."""
    names: list[str] = []
    for token in _split_top(text, where):
        names.extend(_expand_token(token, where))
        if len(names) > MAX_NODES:
            raise HostfileError("node list too long", where, f"more than {MAX_NODES} nodes",
                                "check the list for a mistyped range")
    if not names:
        raise HostfileError("empty node list", where, f"{text!r} names no node",
                            "run inside an allocation (salloc/sbatch) or pass --hostfile")
    return names


def expand_counts(text: str, where: str) -> list[int]:
    """``4(x2),2`` -> [4, 4, 2]: SLURM_TASKS_PER_NODE / SLURM_JOB_CPUS_PER_NODE."""
    counts: list[int] = []
    for part in text.split(","):
        match = _COUNT_RE.match(part.strip())
        if match is None:
            raise HostfileError("unreadable per-node counts", where, f"{text!r}",
                                "expected Slurm's form, e.g. 4(x2),2")
        counts.extend([int(match[1])] * int(match[2] or 1))
    return counts


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


def _expand_token(token: str, where: str) -> list[str]:
    """One name with zero or more bracket groups: ``a[1-2]b[08-10]``."""
    parts = re.split(r"\[([^\]]*)\]", token)
    # parts alternates text, bracket body, text, ...; the last text must be empty (Slurm 22).
    if len(parts) > 1 and parts[-1]:
        raise HostfileError("unsupported node list", where, f"text {parts[-1]!r} follows the "
                            f"last bracket in {token!r}", "name nodes as prefix[range]")
    texts, groups = parts[0::2], [_expand_group(body, token, where) for body in parts[1::2]]
    return ["".join(t + n for t, n in zip(texts, (*combo, ""), strict=True))
            for combo in itertools.product(*groups)]


def _expand_group(body: str, token: str, where: str) -> list[str]:
    numbers: list[str] = []
    for part in body.split(","):
        match = _RANGE_RE.match(part.strip())
        if match is None:
            raise HostfileError("bad range in node list", where, f"{part!r} in {token!r}",
                                "use numbers and lo-hi ranges, e.g. gpu[01-04,07]")
        low_text, high_text = match[1], match[2] or match[1]
        low, high = int(low_text), int(high_text)
        if high < low or high - low > MAX_NODES:
            raise HostfileError("bad range in node list", where, f"{part!r} in {token!r}",
                                "give lo-hi with lo <= hi")
        numbers.extend(str(n).zfill(len(low_text)) for n in range(low, high + 1))
    return numbers
