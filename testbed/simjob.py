"""One job on a simulated cluster (or on real local agents), measured: the API tests and
`bench.sim_scale` call.

`run_job` starts ``workers`` `testbed.simcluster` processes, then the head as its own process
(`testbed.simhead`: `dtrain launch` over the `sim` row), waits for it, stops the workers and
reads everyone's stamps. With ``real=True`` there are no simcluster processes: every host is a
real agent subprocess (`counted-local`) and every rank a real process playing the same PMI-1
conversation (`testbed/simrank.py`), which is the fidelity reference.

Times are seconds from ``t0``, taken just before the head's process starts (as
`bench.launch_time` does): ``running`` every rank running, ``fenced`` every rank past MPI_Init's
fence, ``wired`` every rank past its gets, ``last_exit`` the last rank's exit, ``returned`` the
head's launch returned, ``head_exit`` its process ended; ``exit_tail`` = returned - last_exit;
``agents_left`` the last simulated agent's connection closed (`testbed.simcluster.LEFT`);
``workers_use`` the simcluster processes' user and system CPU and context switches, summed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from testbed.simcluster import IDLE_VARIABLE
from testbed.simrank import CARD_CHARS, EXCHANGES, FENCED, FINALIZED, PEER_GETS, WIRED
from testbed.sshd import free_port

REPO = Path(__file__).resolve().parent.parent
RANK_SCRIPT = Path(__file__).resolve().parent / "simrank.py"
#: Hosts per simcluster process: each host costs the process ~20 files (its PMI socket pairs,
#: the connection, the selector) and 4 threads, which share the process's one GIL. A real
#: agent's 4 threads have their process to themselves; hundreds of agents' threads queueing
#: for one GIL cost the simulator, not the agent: 256 simulated hosts in one process took 5.7 s
#: of CPU (3.9 s of it system time) and 525,000 context switches, in 4 processes 3.2 s and
#: 147,000, in 8 3.2 s and 84,000 (`bench.sim_scale`, 2026-11-29, loaded machine). More
#: processes cost their start-up (imports, ~40 MiB each): 16 of 16 hosts took 4.3 s.
HOSTS_PER_WORKER = 64


def workers_for(hosts: int) -> int:
    return max(1, -(-hosts // HOSTS_PER_WORKER))


def run_job(hosts: int, ranks: int, *, workers: int | None = None, gets: int = PEER_GETS,
            real: bool = False, timeout: float = 600.0, extra: Sequence[str] = (),
            heartbeat: float | None = None, rendezvous: bool = False,
            profile: Path | None = None, card_chars: int = CARD_CHARS,
            exchange: str = EXCHANGES[0], idle: bool = False) -> dict[str, Any]:
    """Launch, fence and end one job of ``hosts`` x ``ranks``; its measurements (see module).
    ``extra`` goes to `dtrain launch` before the program (e.g. ``--fanout 4``).
    ``heartbeat`` sets --heartbeat-interval: hundreds of simulated hosts share this machine's
    cores with everything else on it, and a starved process's agents may miss the default's
    15 s silence limit, which real hosts with cores of their own would not. With
    ``profile`` (a folder), the head and the first worker run under ``py-spy record`` and leave
    their sampled stacks there (`head.txt`, `worker0.txt`, py-spy's raw format; the other
    workers serve the same share of hosts, and a sampler per process would load the machine). With
    ``rendezvous``, the head listens (`--launcher rendezvous`) and the simulated hosts join it
    (token handshake, roster) instead of being dialled. ``card_chars`` is each rank's
    business card's length in the light exchange; ``exchange`` the address exchange the ranks
    play (`testbed.simrank.EXCHANGES`; with "mpich", ``gets`` is the hosts whose cards each
    host's first rank reads). ``idle``: the simulation runs at SCHED_IDLE, below the head
    (`testbed.simcluster.yield_to_head`: a bench measuring the head)."""

    def spied(name: str) -> list[str]:
        if profile is None or name not in ("head", "worker0"):
            return []  # one simulator process stands for the others (same share of hosts)
        spy = Path(sys.executable).parent / "py-spy"
        return [str(spy), "record", "--format", "raw", "--rate", "100", "--gil",
                "--nonblocking", "-o", str(profile / f"{name}.txt"), "--"]

    with tempfile.TemporaryDirectory(prefix="dtrain-sim-") as tmp:
        folder = Path(tmp)
        (folder / "stamps").mkdir()
        env = {**os.environ, "DTRAIN_SIM_GETS": str(gets), "OMP_NUM_THREADS": "1",
               "DTRAIN_SIM_CARD_CHARS": str(card_chars), "DTRAIN_SIM_EXCHANGE": exchange,
               "PYTHONPATH": str(REPO), "DTRAIN_SIM_STAMPS": str(folder / "stamps"),
               "DTRAIN_SIM_PHASES": "1", **({IDLE_VARIABLE: "1"} if idle else {})}
        hostfile = folder / "hosts"
        hostfile.write_text("".join(f"sim{i + 1} slots={ranks}\n" for i in range(hosts)))
        procs: list[subprocess.Popen[bytes]] = []
        ports: list[str] = []
        count = 0 if real else (workers or workers_for(hosts))
        names = [f"sim{i + 1}" for i in range(hosts)]
        head_args = ["--hostfile", str(hostfile)]
        join_args: list[list[str]] = [[] for _ in range(count)]
        if rendezvous:
            token, port = folder / "token", free_port()
            token.write_text(_token() + "\n")
            token.chmod(0o600)
            head_args = ["--rendezvous-port", str(port), "--nnodes", str(hosts),
                         "--token-file", str(token), "--rendezvous-timeout", str(timeout)]
            join_args = [["--join", f"127.0.0.1:{port}", "--token-file", str(token),
                          "--names", ",".join(names[w::count])] for w in range(count)]
        head: Any = None
        try:
            if rendezvous:  # the head listens first; the agents keep trying until it does
                head = _start_head(spied("head"), folder, ports, "rendezvous", head_args,
                                   ranks, extra, heartbeat, env, real=False)
                t0 = time.monotonic()
            for w in range(count):  # all started first: their imports overlap
                procs.append(subprocess.Popen(
                    [*spied(f"worker{w}"), sys.executable, "-m", "testbed.simcluster", "--stats",
                     str(folder / f"worker{w}.json"), "--gets", str(gets), *join_args[w]],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, env=env))
            for proc in procs:
                assert proc.stdout is not None
                line = b""
                while not line.strip().isdigit():  # py-spy, when profiling, speaks first
                    line = proc.stdout.readline()
                    if not line:
                        raise RuntimeError("a simcluster process ended before it listened")
                ports.append(line.decode().strip())
            if head is None:
                t0 = time.monotonic()
                head = _start_head(spied("head"), folder, ports,
                                   "counted-local" if real else "sim", head_args, ranks, extra,
                                   heartbeat, env, real=real)
            try:
                out, err = head.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:  # stopped as a user would: it says where it was
                head.terminate()
                try:
                    out, err = head.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    head.kill()
                    out, err = head.communicate()
            head_exit = time.monotonic()
            head = subprocess.CompletedProcess(head.args, head.returncode, out, err)
        finally:
            if isinstance(head, subprocess.Popen) and head.poll() is None:
                head.kill()  # an error above: the head we started goes too
                head.wait()
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.close()
            for proc in procs:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:  # starved past its minute: ours to end
                    proc.kill()
                    proc.wait()
        if not (folder / "head.json").exists():
            raise RuntimeError(f"the head left no stats (exit {head.returncode}): "
                               f"{head.stderr.decode(errors='replace')[-2000:]}")
        head_stats = json.loads((folder / "head.json").read_text())
        stamps: list[dict[str, Any]] = []
        agents: dict[str, int] = {}
        left: dict[str, float] = {}
        worker_cpu = 0.0
        worker_use: dict[str, float] = {}
        for w in range(len(procs)):
            if not (folder / f"worker{w}.json").exists():
                raise RuntimeError(f"simcluster worker {w} left no stats (killed after the head "
                                   f"ended, exit {head.returncode}): "
                                   f"{head.stderr.decode(errors='replace')[-2000:]}")
            stats = json.loads((folder / f"worker{w}.json").read_text())
            stamps += stats["ranks"]
            agents.update(stats["agents"])
            left.update(stats.get("left") or {})
            worker_cpu += stats["cpu_s"]
            for key in ("user_s", "sys_s", "switches", "forced_switches"):
                worker_use[key] = worker_use.get(key, 0) + stats.get(key, 0)
        for path in sorted((folder / "stamps").iterdir()):  # real ranks' own
            stamps.append(json.loads(path.read_text()))
    return {**_summary(hosts, ranks, t0, head_exit, head, head_stats, stamps, agents,
                       worker_cpu, real=real, left=left),
            "workers_use": {k: round(v, 3) for k, v in worker_use.items()}}


def _start_head(spy: list[str], folder: Path, ports: list[str], launcher: str,
                hosts: list[str], ranks: int, extra: Sequence[str], heartbeat: float | None,
                env: dict[str, str], *, real: bool) -> subprocess.Popen[bytes]:
    program = [sys.executable, str(RANK_SCRIPT)] if real else ["/bin/true"]
    command = [*spy, sys.executable, "-m", "testbed.simhead", "--stats",
               str(folder / "head.json"), "--ports", ",".join(ports), "--launcher", launcher,
               "--", *hosts, "--nproc-per-node", str(ranks),
               *(("--heartbeat-interval", str(heartbeat)) if heartbeat else ()),
               *extra, "--", *program]
    return subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)



def _token() -> str:
    from launcher.rendezvous.tokens import new

    return new()


def _summary(hosts: int, ranks: int, t0: float, head_exit: float,
             head: subprocess.CompletedProcess[bytes], head_stats: dict[str, Any],
             stamps: list[dict[str, Any]], agents: dict[str, int], worker_cpu: float, *,
             real: bool, left: dict[str, float] | None = None) -> dict[str, Any]:
    def last(key: str, otherwise: str = "") -> float | None:
        values = [s.get(key, s.get(otherwise)) for s in stamps if key in s or otherwise in s]
        return round(max(values) - t0, 4) if values and len(values) == len(stamps) else None

    returned = head_stats["returned"] - t0
    phases: dict[str, float] = head_stats.get("phases") or {}
    exits = [s["exit"] for s in stamps if "exit" in s]
    last_exit_at = max(exits) if exits and len(exits) == len(stamps) else None
    joined = head_stats.get("joined")
    last_exit = last("exit")
    last_done = head_stats.get("last_done")
    gone = list((left or {}).values())
    return {
        "hosts": hosts, "ranks_per_host": ranks, "mode": "real" if real else "sim",
        # The head's own exit code (under py-spy the process's code is py-spy's).
        "code": head.returncode if head_stats["code"] is None else head_stats["code"],
        "rank_codes": sorted({s["code"] for s in stamps}, key=str),
        "ranks_seen": len(stamps), "agent_codes": sorted(set(agents.values())),
        "agents_seen": len(agents),
        "joined": None if joined is None else round(joined - t0, 4),
        # A rank that reads no card (MPICH's exchange: all but each host's first) is wired up
        # at its fence.
        "running": last("running"), "fenced": last(FENCED),
        "wired": last(WIRED, FENCED),
        "finalized": last(FINALIZED), "last_exit": last_exit, "returned": round(returned, 4),
        "head_exit": round(head_exit - t0, 4),
        "exit_tail": round(returned - last_exit, 4) if last_exit is not None else None,
        # The head's end-of-job steps (`testbed.simhead.PHASES`) and the exit tail split by
        # them: the supervisor's loop seeing every host done after the last rank's exit, the
        # agents' leaving after their BYE (on shared cores here: the simulator's), the rest
        # (closing the streams, the report).
        "phases": {k: round(v - t0, 4) for k, v in phases.items()},
        "tail_parts": {"loop": round(phases["loop_end"] - last_exit_at, 4),
                       # of the loop: until the head read the last DONE (the agents' reports
                       # on these shared cores), then until its loop had seen it
                       **({"reported": round(last_done - last_exit_at, 4),
                           "seen": round(phases["loop_end"] - last_done, 4)}
                          if last_done is not None else {}),
                       "dismiss": round(phases["dismissed"] - phases["dismiss"], 4),
                       "after": round(phases["reported"] - phases["dismissed"], 4)}
        if last_exit_at is not None and {"loop_end", "dismiss", "dismissed", "reported"}
        <= phases.keys() else None,
        # when the last simulated agent left (its connection closed), from t0
        "agents_left": round(max(gone) - t0, 4) if gone else None,
        "head_cpu_s": round(head_stats["cpu_s"], 3),
        "head_maxrss_mib": round(head_stats["maxrss_kib"] / 1024, 1),
        "workers_cpu_s": round(worker_cpu, 3),
        "frames": head_stats["frames"],
        "stderr_head": head.stderr.decode(errors="replace")[:2000],  # the first failure
        "stderr_tail": head.stderr.decode(errors="replace")[-2000:],
    }


def frame_counts(result: dict[str, Any]) -> dict[str, dict[str, int]]:
    """{"out"|"in": {kind: frames}}: what fidelity compares (bytes differ with timings)."""
    return {d: {k: v[0] for k, v in kinds.items()} for d, kinds in result["frames"].items()}
