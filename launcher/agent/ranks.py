"""Starting, watching and stopping one host's rank processes (the agent's subprocess adapter).

Each rank runs in its own session, hence its own process group, so a signal to the group
reaches everything the rank started (shells, data-loader workers) and nothing outside the job.
Each rank also gets PR_SET_PDEATHSIG=SIGKILL: if the agent itself is SIGKILLed, the kernel
kills the ranks, so no path leaves an orphan holding a GPU.

Output: two pump threads per rank read its stdout and stderr pipes and hand each chunk to
``on_output``, which blocks while the agent's output queue is full; the pump then stops
reading, the pipe fills, and the rank blocks in ``write`` (back-pressure). A rank's exit is
reported once its pumps have relayed everything, however long a slow head takes; pipes kept
open by the rank's own children stop the wait after `PUMP_WAIT_S` of the pumps' own time
(time spent waiting for a slow head does not count).
"""

from __future__ import annotations

import ctypes
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from records import Record, field

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from typing import Any

_PR_SET_PDEATHSIG = 1
PUMP_WAIT_S = 2.0  # after the rank exited: how long its pumps may read before we report
try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # not Linux: no parent-death signal, the EOF/heartbeat paths still apply
    _libc = None


def _child_setup() -> None:
    # Runs in the child between fork and exec: plain system calls only. The agent ignores
    # SIGINT/SIGHUP (the head decides), and ignored signals survive exec; the rank must get
    # the defaults back so a forwarded Ctrl-C reaches it (KeyboardInterrupt in Python).
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        _libc.signal(signal.SIGINT, 0)   # 0 == SIG_DFL
        _libc.signal(signal.SIGHUP, 0)


class RankExited(Record, frozen=True):
    """Queued when a rank's process has exited and all of its output has been relayed."""

    rank: int
    code: int          # exit status, or 128+signal when killed by a signal
    signal: int | None


class _Pump(threading.Thread):
    """Relays one pipe of a rank; counts what it relayed so a waiter can see progress."""

    def __init__(self, rank: int, stream: int, pipe: Any,
                 on_output: Callable[[int, int, bytes], object]) -> None:
        super().__init__(daemon=True, name=f"rank{rank}-{stream}")
        self.rank, self.stream, self.pipe, self.on_output = rank, stream, pipe, on_output
        self.relaying = False   # inside on_output (possibly blocked by back-pressure)

    def run(self) -> None:
        fd = self.pipe.fileno()
        try:
            while True:
                data = os.read(fd, 65536)
                if not data:
                    break
                self.relaying = True
                self.on_output(self.rank, self.stream, data)
                self.relaying = False
        except OSError:
            pass
        finally:
            self.pipe.close()


class RankProcess(Record):
    rank: int
    proc: subprocess.Popen[bytes]
    pumps: list[_Pump] = field(default_factory=list)
    #: The signals this agent sent the rank (SIGCONT aside), with when (monotonic): its EXIT
    #: says who stopped it, so a report tells dtrain's SIGKILL after the grace from the OOM
    #: killer's, and an exit 143 after dtrain's SIGTERM from one after somebody else's.
    sent: list[tuple[int, float]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def watch(self, on_output: Callable[[int, int, bytes], object],
              events: queue.Queue[Any]) -> None:
        """Relay stdout and stderr to ``on_output`` (a thread each); queue `RankExited` once it
        has exited and its output is relayed (a third thread). Called once every rank of the
        host is started: each forked child tidies up after every thread of the agent before it
        runs the rank, so threads started between spawns made each spawn slower (4 ranks on a
        loaded 2-core machine: 62 ms with them in between, 32 ms after)."""
        for stream, pipe in ((1, self.proc.stdout), (2, self.proc.stderr)):
            pump = _Pump(self.rank, stream, pipe, on_output)
            pump.start()
            self.pumps.append(pump)
        threading.Thread(target=_reap, args=(self, events), daemon=True,
                         name=f"reap{self.rank}").start()

    def signal_group(self, sig: int) -> None:
        """Signal the rank's whole process group; a group already gone is not an error."""
        if sig != signal.SIGCONT:
            self.sent.append((sig, time.monotonic()))
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def sent_report(self) -> list[list[float]]:
        """``sent`` for the EXIT frame: each signal once, seconds after the first signal."""
        first: dict[int, float] = {}
        for sig, at in self.sent:
            first.setdefault(sig, at)
        start = min(first.values(), default=0.0)
        return [[sig, round(at - start, 2)] for sig, at in first.items()]


def find_program(argv0: str, env: Mapping[str, str], cwd: str) -> str | None:
    """The path argv[0] would run, looked up like execvp would; None when not found."""
    if os.sep in argv0:
        path = argv0 if os.path.isabs(argv0) else os.path.join(cwd, argv0)
        return path if os.access(path, os.X_OK) and not os.path.isdir(path) else None
    return shutil.which(argv0, path=env.get("PATH", os.defpath))


def check_job(cwd: str, argv0: str, env: Mapping[str, str]) -> dict[str, str] | None:
    """Why this host cannot run the job (an ERROR frame's body), or None: the working directory
    exists and argv[0] is an executable a rank with ``env`` would find."""
    if not os.path.isdir(cwd):
        return {"what": "working directory missing", "why": f"{cwd} does not exist here",
                "fix": "create it on every host, or pass --chdir DIR"}
    if find_program(argv0, env, cwd) is None:
        return {"what": "program not found", "why": f"{argv0!r} is not an executable in "
                f"PATH or {cwd}", "fix": "install it on every host or give its full path"}
    return None


def start_rank(
    rank: int,
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    pass_fds: Sequence[int],
    stdin_pipe: bool = False,
) -> RankProcess:
    """Start one rank, its output not read yet (`RankProcess.watch`). Its stdin is /dev/null,
    or a pipe (``proc.stdin``) with ``stdin_pipe`` (rank 0)."""
    proc = subprocess.Popen(
        list(argv),
        env=dict(env),
        cwd=cwd,
        stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=tuple(pass_fds),
        start_new_session=True,
        preexec_fn=_child_setup,
    )
    return RankProcess(rank, proc)


def _wait_pumps(pumps: Sequence[_Pump]) -> None:
    """Until every pump is done, or they have read for `PUMP_WAIT_S` not held by the head."""
    budget, last = PUMP_WAIT_S, time.monotonic()
    while any(p.is_alive() for p in pumps):
        for p in pumps:
            p.join(0.1)
        now = time.monotonic()
        if not any(p.relaying for p in pumps):
            budget -= now - last  # held by a slow head: that time is not the rank's
        last = now
        if budget <= 0:
            return  # the rank's children keep the pipes open: do not delay the exit report


def _reap(rp: RankProcess, events: queue.Queue[Any]) -> None:
    status = rp.proc.wait()
    _wait_pumps(rp.pumps)
    if status < 0:
        events.put(RankExited(rp.rank, 128 - status, -status))
    else:
        events.put(RankExited(rp.rank, status, None))
