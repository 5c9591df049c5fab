"""A rank program that floods its output: `flood.py LINES LONG [STAMPS]`, and its checkers.

Prints LINES short lines `<rank> <i> <filler>` (i = 0..LINES-1, in blocks of 1000 lines per
write, as a chatty trainer would through a block-buffered stdout), with one line of LONG bytes
of `z` after the block holding the middle line, then `<rank> end`. The rank is $RANK (dtrain)
or $PMI_RANK (mpiexec). With STAMPS, a directory, the rank writes ``time.time()`` into
``STAMPS/<rank>`` just before its first write. Used by tests/launcher/test_output_flood.py and
bench/output.py.
"""

from __future__ import annotations

import os
import re
import sys
import time

FILLER = "abcdefghij" * 3
BLOCK = 1000
# `[rank@host] ` (dtrain) or `[rank] ` (mpiexec -prepend-rank)
_PREFIX = re.compile(rb"\[(\d+)(?:@[\w.-]+)?\] ")
_ANY_PREFIX = re.compile(rb"\[\d+(?:@[\w.-]+)?\] ")
_RANK = re.compile(rb"(\d+) ")


def expected(rank: int, lines: int, long: int) -> list[bytes]:
    """The lines one rank prints, without line ends."""
    out = [b"%d %d %s" % (rank, i, FILLER.encode()) for i in range(lines)]
    if lines:
        out.insert(min(lines, (lines // 2 // BLOCK + 1) * BLOCK), b"%d long " % rank + b"z" * long)
    out.append(b"%d end" % rank)
    return out


def problems(stdout: bytes, ranks: int, lines: int, long: int, *, prefixed: bool) -> str | None:
    """None when every rank's lines arrived whole, once each and in order; else what is wrong."""
    if stdout and not stdout.endswith(b"\n"):
        return "the output does not end with a whole line"
    got: dict[int, list[bytes]] = {r: [] for r in range(ranks)}
    for line in stdout.split(b"\n")[:-1]:
        if prefixed:
            m = _PREFIX.match(line)
            if not m:
                return f"a line without a rank prefix: {line[:80]!r}"
            line = line[m.end():]
            if not line.startswith(m.group(1) + b" "):
                return f"rank {int(m.group(1))}'s prefix on another rank's line: {line[:80]!r}"
        head = _RANK.match(line)
        rank = int(head.group(1)) if head else -1
        if rank not in got:
            return f"a line from no rank: {line[:80]!r}"
        got[rank].append(line)
    for rank, seen in got.items():
        want = expected(rank, lines, long)
        if seen != want:
            return (f"rank {rank}: {len(seen)} of {len(want)} lines arrived, "
                    f"{sum(a != b for a, b in zip(seen, want, strict=False))} differ")
    return None


def lost(stdout: bytes, ranks: int, lines: int, long: int) -> str | None:
    """None when no byte was lost or added, prefixes aside (lines may be mixed across ranks,
    as mpiexec mixes them); else what is wrong."""
    body = _ANY_PREFIX.sub(b"", stdout)
    want = [expected(rank, lines, long) for rank in range(ranks)]
    count = sum(len(w) for w in want)
    size = sum(len(line) + 1 for w in want for line in w)
    got = body.count(b"\n")
    if got != count or len(body) != size:
        return f"{got} of {count} lines, {len(body)} of {size} bytes arrived"
    return None


def main() -> None:
    lines, long = int(sys.argv[1]), int(sys.argv[2])
    rank = int(os.environ.get("RANK") or os.environ["PMI_RANK"])
    out = sys.stdout.buffer
    want = expected(rank, lines, long)
    if len(sys.argv) > 3:
        with open(os.path.join(sys.argv[3], str(rank)), "w") as stamp:
            stamp.write(repr(time.time()))
    for start in range(0, len(want), BLOCK):
        out.write(b"".join(line + b"\n" for line in want[start:start + BLOCK]))
    out.flush()


if __name__ == "__main__":
    main()
