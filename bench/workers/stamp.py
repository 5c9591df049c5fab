"""Rank program for the launch-time bench: stamp the moment it runs, then exit 0.

    python stamp.py STAMP_DIR [LOCAL_INDEX]

Only small built-in modules are imported before the stamp, so it measures the launcher, not
this program. It writes ``STAMP_DIR/<hostname>-<pid>.json``; hosts are network namespaces
sharing one filesystem and one PID namespace, so the name is unique across the whole job. The
rank id is whatever the launcher provided (``RANK`` from dtrain, ``PMI_RANK`` from Hydra, the
loop index from the pdsh command line): the bench only counts stamps, it does not need it.
"""

import json
import os
import socket
import sys
import time


def write_stamp(out_dir: str, stamp: dict) -> None:
    """``<out_dir>/<host>-<pid>.json``, renamed into place so a reader never sees half."""
    path = os.path.join(out_dir, f"{stamp['host']}-{stamp['pid']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(stamp, f)
    os.rename(path + ".tmp", path)


def main() -> None:
    start = time.time()
    rank = os.environ.get("RANK") or os.environ.get("PMI_RANK") or (sys.argv[2:3] or ["?"])[0]
    write_stamp(sys.argv[1], {"host": socket.gethostname(), "pid": os.getpid(), "rank": rank,
                              "start": start})


if __name__ == "__main__":
    main()
