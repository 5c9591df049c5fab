"""Rank program for the launch-time bench: stamp the moment it runs, then exit 0.

    python stamp.py STAMP_DIR [LOCAL_INDEX]

The stamp is taken before any other import so it measures the launcher, not this program.
It writes ``STAMP_DIR/<hostname>-<pid>.json``; hosts are network namespaces sharing one
filesystem and one PID namespace, so the name is unique across the whole job. The rank id is
whatever the launcher provided (``RANK`` from dtrain, ``PMI_RANK`` from Hydra, the loop index
from the pdsh command line): the bench only counts stamps, it does not need it.
"""

import time

START = time.time()

import json
import os
import socket
import sys


def main() -> None:
    host, pid = socket.gethostname(), os.getpid()
    rank = os.environ.get("RANK") or os.environ.get("PMI_RANK") or (sys.argv[2:3] or ["?"])[0]
    stamp = {"host": host, "pid": pid, "rank": rank, "start": START}
    path = os.path.join(sys.argv[1], f"{host}-{pid}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(stamp, f)
    os.rename(path + ".tmp", path)  # the bench never reads half a stamp


if __name__ == "__main__":
    main()
