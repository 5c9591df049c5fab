"""A rank program that floods its output: `flood.py LINES LONG [--stderr]`.

Prints LINES short lines `<rank> <i> <filler>` (i = 0..LINES-1, in blocks of 1000 lines per
write, as a chatty trainer would through a block-buffered stdout), with one line of LONG
bytes of `z` after the first half, then `<rank> end`. `check_flood` in tests/test_output_flood.py
verifies that every line arrived complete and in order for each rank.
"""

import os
import sys

FILLER = "abcdefghij" * 3


def main() -> None:
    lines, long = int(sys.argv[1]), int(sys.argv[2])
    rank = os.environ.get("RANK") or os.environ["PMI_RANK"]  # dtrain, or mpiexec (Hydra)
    out = sys.stdout
    for start in range(0, lines, 1000):
        out.write("".join(f"{rank} {i} {FILLER}\n" for i in range(start, min(lines, start + 1000))))
        if start <= lines // 2 < start + 1000:
            out.write(f"{rank} long {'z' * long}\n")
    out.write(f"{rank} end\n")
    out.flush()


if __name__ == "__main__":
    main()
