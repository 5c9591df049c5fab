"""The agent's side of progress records: a private folder, reading, stacks (adapter).

Each rank gets ``DTRAIN_PROGRESS_FILE`` (and ``TORCHELASTIC_ERROR_FILE``: `launcher.errorfile`)
in a folder of its own job made with ``mkdtemp`` (mode 0700) in /dev/shm (memory; the temp dir
where it is missing) and removed when the agent leaves or the round ends;
its name marks the agent, so that the next agent on the host removes it if this one is killed
(`launcher.agent.leftovers`, run before the folder is made; both through the agent's
`launcher.agent.host.Host`, which also reads /proc). The agent reads the records without the
ranks' help (layout in `workerenv`), notes the share of a core each rank used since an
earlier reading (/proc: a rank busy outside communication is working, not hung;
`launcher.hang.watch`) and sends the head one PROGRESS frame per interval, one when the head
asks (PROBE, with the Python stacks of the ranks it names when `py-spy` is installed), and a
last one when every rank has exited (the end-of-run straggler report). Stacks are taken on a
thread of their own: py-spy may take seconds and the agent's
loop must keep its heartbeats.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping

import workerenv
from launcher import errorfile
from launcher.agent import flight
from launcher.agent.host import Host
from launcher.hang.views import RankView, view_of

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from typing import Any

    from launcher.agent.ranks import RankExited

STACK_TIMEOUT_S = 10.0
CPU_WINDOW_S = 0.5


class ProgressReporter:
    def __init__(self, job_id: str, host: str, ranks: list[int], interval: float,
                 send: Callable[[dict[str, Any]], object],
                 fenced: Callable[[], frozenset[int]] = frozenset,
                 machine: Host | None = None) -> None:
        """``fenced``: the ranks in a PMI barrier now (`PmiProxy.fenced`); ``machine``: where
        the records' folder is made and the ranks' /proc read (`launcher.agent.host`)."""
        self._machine = machine or Host()
        self.folder = self._machine.records_folder(job_id)
        self.host, self.ranks, self.interval, self._send = host, ranks, interval, send
        self._next = 0.0
        self._cpu: dict[int, tuple[float, float, float]] = {}  # rank: cpu s, at, last share
        self._fenced = fenced
        self._fenced_at: dict[int, float] = {}  # rank -> when it was first seen fenced
        self._codes: dict[int, int] = {}  # rank -> exit status of those that exited

    def path(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank-{rank}.progress")

    def rank_env(self, rank: int, env: dict[str, str]) -> dict[str, str]:
        """Its progress record, its Flight Recorder's reader (`launcher.agent.flight`) and
        its error file: one per rank, as torchrun gives (a shared one holds the last
        writer's). ``env``: the rank's environment so far (the user's settings)."""
        return {workerenv.PROGRESS_FILE: self.path(rank),
                **flight.rank_env(env, self.path(rank), self.interval),
                errorfile.VARIABLE: errorfile.path(self.folder, rank)}

    def error(self, ev: RankExited) -> dict[str, Any]:
        """For a failed rank's EXIT frame: what its error file says (the head's summary)."""
        self._codes[ev.rank] = ev.code  # how it ended, for the hang diagnosis's views
        cause = errorfile.read(errorfile.path(self.folder, ev.rank)) if ev.code else None
        return {"error": cause.to_json()} if cause is not None else {}

    def views(self, pids: Mapping[int, int]) -> list[RankView]:
        """Every rank of this host; ``pids`` holds the live ones (the others have exited).

        The folder is listed once per reading and only the files it holds are opened: a
        rank that has written nothing (yet, or ever: a program without records) costs no
        system call. Three per rank per reading, whether or not the files existed, were the
        largest part of a simulated host's work (`bench.sim_scale`, 1,024 hosts)."""
        now = time.monotonic()  # the records' clock (`workerenv`)
        fenced = self._fenced()
        self._fenced_at = {r: self._fenced_at.get(r, now) for r in fenced}
        try:
            present = frozenset(os.listdir(self.folder))
        except OSError:  # gone (the round ended) or out of files: nothing to read now
            present = frozenset()
        out = []
        for rank in self.ranks:
            name = f"rank-{rank}.progress"
            record = self._record(self.path(rank), present, name)
            pid = record.pid if record else pids.get(rank)
            returned = flight.path(name) + ".left" in present  # the shim's marker
            gone = rank not in pids or returned
            state, cpu, runnable = ("exited", None, False) if gone else self._machine.stat(pid)
            since = self._fenced_at.get(rank)
            out.append(view_of(record, rank=rank, host=self.host, state=state, now=now,
                               pid=pid or 0, cpu_share=self._share(rank, cpu, now),
                               fence_age=None if since is None else now - since,
                               code=self._codes.get(rank), returned=returned,
                               runnable=runnable, recorder=flight.recorder(record)))
        return out

    @staticmethod
    def _record(path: str, present: frozenset[str], name: str
                ) -> workerenv.RankProgress | None:
        """The rank's record (``name`` in ``present``: the folder's listing); None when it
        has none yet, or when it cannot be read now: out of files (a flood of connections
        to the PMI port) or memory is the next reading's problem, never the agent's end."""
        if name in present:
            try:
                return workerenv.read_progress(_reader(path))
            except OSError:
                return None
        if flight.path(name) in present:  # a torch.distributed program's, if any
            return flight.read(flight.path(path))
        return None

    def _share(self, rank: int, cpu: float | None, now: float) -> float:
        """The share of a core ``rank`` used since the reading at least `CPU_WINDOW_S` ago
        (shorter windows would see the kernel's 10 ms accounting ticks, not the rate)."""
        if cpu is None:
            self._cpu.pop(rank, None)
            return 0.0
        base_cpu, base_at, share = self._cpu.get(rank, (cpu, now, 0.0))
        if now - base_at >= CPU_WINDOW_S:
            share = max(0.0, cpu - base_cpu) / (now - base_at)
            base_cpu, base_at = cpu, now
        self._cpu[rank] = (base_cpu, base_at, share)
        return share

    @property
    def next_due(self) -> float:
        """When `tick` next reads and sends the records (monotonic; never, without an
        interval)."""
        return self._next if self.interval > 0 else float("inf")

    def tick(self, now: float, pids: Mapping[int, int]) -> None:
        if self.interval > 0 and now >= self._next:
            self._next = now + self.interval
            self._send({"ranks": [v.to_json() for v in self.views(pids)]})

    def final(self) -> None:
        """Every rank has exited: their last records, once."""
        self._send({"ranks": [v.to_json() for v in self.views({})], "final": True})

    def probe(self, body: dict[str, Any], pids: Mapping[int, int]) -> None:
        """Answer the head's PROBE: the records now, with stacks of the ranks it asks for."""
        wanted = {int(r) for r in body.get("stacks", ())}
        views = self.views(pids)

        def answer() -> None:
            targets = {v.rank: v.pid for v in views if v.rank in wanted and v.pid}
            found = stacks(targets, native=bool(body.get("native")))
            self._send({"ranks": [v.to_json() for v in views], "stacks": found,
                        "probe": body.get("probe")})

        threading.Thread(target=answer, name="progress-probe", daemon=True).start()

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _reader(path: str) -> Callable[[], bytes]:
    def read() -> bytes:
        with open(path, "rb") as f:
            return f.read()
    return read


def py_spy() -> str | None:
    """py-spy from PATH or next to this interpreter (a virtualenv's bin, not always on PATH)."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return shutil.which("py-spy") or (beside if os.path.exists(beside) else None)


def stacks(pids: Mapping[int, int], native: bool = False) -> dict[str, str]:
    """rank -> its Python stack (``py-spy dump``), taken in parallel; {} without py-spy.
    ``native``: with the C frames (the MPI call a rank is in), pausing each rank a moment."""
    exe = py_spy()
    if exe is None or not pids:
        return {}
    found: dict[str, str] = {}

    def dump(rank: int, pid: int) -> None:
        # --nonblocking reads the process's memory without pausing it, so a stopped rank
        # (SIGSTOP) is read too and a running one is not disturbed.
        how = "--native" if native else "--nonblocking"
        try:
            done = subprocess.run([exe, "dump", how, "--pid", str(pid)],
                                  capture_output=True, text=True, timeout=STACK_TIMEOUT_S)
            found[str(rank)] = done.stdout if done.returncode == 0 else \
                f"(py-spy failed: {done.stderr.strip()[-300:]})"
        except (OSError, subprocess.TimeoutExpired) as exc:
            found[str(rank)] = f"(py-spy failed: {exc})"

    threads = [threading.Thread(target=dump, args=(r, p), daemon=True) for r, p in pids.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(STACK_TIMEOUT_S + 1)
    return found
