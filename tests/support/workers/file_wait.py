"""A program that uses neither torch.distributed nor MPI (dtrain sees no record of it): each
rank waits for a file that never comes, sleeping between looks.

    python tests/support/workers/file_wait.py FOLDER    # rank R waits for FOLDER/go-R
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.2)


def main() -> None:
    rank = int(os.environ["RANK"])
    print(f"rank {rank} waits", flush=True)
    wait_for(Path(sys.argv[1]) / f"go-{rank}")


if __name__ == "__main__":
    main()
