"""A rank program for launcher tests: records its PID, then does what the first argument says.

    probe.py env                 print the contract variables as one JSON line
    probe.py argv ARGS...        print ARGS as a JSON list (byte-exact transport check)
    probe.py fail RANK CODE      rank RANK exits with CODE after the others started; others sleep
    probe.py signal RANK SIGNUM  rank RANK kills itself with SIGNUM; others sleep
    probe.py sleep SECONDS       every rank sleeps
    probe.py child SECONDS       every rank starts a child in its process group, then sleeps
    probe.py save S0 S1...       on SIGTERM rank r "saves a checkpoint" for Sr seconds (further
                                 SIGTERMs ignored), says `rank r saved` and exits 143
    probe.py ignore-term         every rank ignores SIGTERM (an exit that hangs) and sleeps

The PID (and children's PIDs) go to $PROBE_PID_DIR/<rank>.pid when that variable is set.
"""

import json
import os
import signal
import subprocess
import sys
import time

KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
        "MASTER_ADDR", "MASTER_PORT", "DTRAIN_JOB_ID", "DTRAIN_HOST", "OMP_NUM_THREADS",
        "PMI_RANK", "PMI_SIZE", "CUDA_VISIBLE_DEVICES", "PROBE_EXTRA")


def record(pids):
    where = os.environ.get("PROBE_PID_DIR")
    if where:
        path = os.path.join(where, f"{os.environ['RANK']}.pid")
        with open(path + ".tmp", "w") as f:
            f.write(" ".join(map(str, pids)) + "\n")
        os.replace(path + ".tmp", path)


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    rank = int(os.environ["RANK"])
    pids = [os.getpid()]
    if mode == "child":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        pids.append(child.pid)
    if mode == "save":
        signal.signal(signal.SIGTERM, lambda *_: save(rank, float(args[rank])))
    elif mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record(pids)
    if mode == "env":
        env = {k: os.environ.get(k) for k in KEYS}
        env["hostname"] = os.uname().nodename
        foreign = ("PMIX_", "OMPI_", "SLURM_")
        env["scrubbed"] = sorted(k for k in os.environ if k.startswith(foreign))
        print(json.dumps(env), flush=True)
    elif mode == "argv":
        print(json.dumps(args), flush=True)
    elif mode == "fail":
        if rank == int(args[0]):
            time.sleep(0.5)
            print(f"rank {rank} failing on purpose", file=sys.stderr, flush=True)
            sys.exit(int(args[1]))
        time.sleep(120)
    elif mode == "signal":
        if rank == int(args[0]):
            time.sleep(0.5)
            os.kill(os.getpid(), int(args[1]))
        time.sleep(120)
    elif mode in ("sleep", "child"):
        print("sleeping", flush=True)
        time.sleep(float(args[0]))
    elif mode in ("save", "ignore-term"):
        print("sleeping", flush=True)
        time.sleep(120)


def save(rank, seconds):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping already: another one changes nothing
    time.sleep(seconds)
    print(f"rank {rank} saved", flush=True)
    os._exit(143)


if __name__ == "__main__":
    main()
