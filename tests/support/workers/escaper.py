"""A rank program whose children leave its process group, then the rank fails or sleeps.

    escaper.py FAIL_RANK CODE

Every rank starts `setsid sleep 1000` (a new session: the group signal misses it) and a
double-forked daemon (`setsid sh -c 'sleep 1000 & echo $!'`: orphaned at once, re-parented away
from the rank), writes both PIDs to $PROBE_PID_DIR/<rank>.pid, then rank FAIL_RANK exits with
CODE while the others sleep.
"""

import os
import subprocess
import sys
import time

rank = int(os.environ["RANK"])
setsid_child = subprocess.Popen(["setsid", "sleep", "1000"])
daemon = subprocess.run(["setsid", "sh", "-c", "sleep 1000 >/dev/null 2>&1 & echo $!"],
                        capture_output=True, text=True, check=True)
pids = [os.getpid(), setsid_child.pid, int(daemon.stdout.strip())]
path = os.path.join(os.environ["PROBE_PID_DIR"], f"{rank}.pid")
with open(path + ".tmp", "w") as f:
    f.write(" ".join(map(str, pids)) + "\n")
os.replace(path + ".tmp", path)
if rank == int(sys.argv[1]):
    time.sleep(0.5)
    sys.exit(int(sys.argv[2]))
time.sleep(120)
