"""The agent's side of progress records: a private folder, reading, stacks (adapter).

Each rank gets ``DTRAIN_PROGRESS_FILE`` in a folder of its own job made with ``mkdtemp`` (mode
0700) in /dev/shm (memory; the temp dir where it is missing) and removed when the agent leaves.
The agent reads the records without the ranks' help (layout in `workerenv`) and sends the head
one PROGRESS frame per interval, one when the head asks (PROBE, with the Python stacks of the
ranks it names when `py-spy` is installed), and a last one when every rank has exited (the
end-of-run straggler report). Stacks are taken on a thread of their own: py-spy may take
seconds and the agent's loop must keep its heartbeats.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import workerenv
from launcher.hang.views import RankView, view_of

STACK_TIMEOUT_S = 10.0
_SHM = "/dev/shm"


class ProgressReporter:
    def __init__(self, job_id: str, host: str, ranks: list[int], interval: float,
                 send: Callable[[dict[str, Any]], object]) -> None:
        base = _SHM if os.path.isdir(_SHM) and os.access(_SHM, os.W_OK) else None
        self.folder = Path(tempfile.mkdtemp(prefix=f"dtrain-{job_id}-", dir=base))
        self.host, self.ranks, self.interval, self._send = host, ranks, interval, send
        self._next = 0.0

    def path(self, rank: int) -> str:
        return str(self.folder / f"rank-{rank}.progress")

    def views(self, pids: Mapping[int, int]) -> list[RankView]:
        """Every rank of this host; ``pids`` holds the live ones (the others have exited)."""
        now = time.monotonic()  # the records' clock (`workerenv`)
        out = []
        for rank in self.ranks:
            path = Path(self.path(rank))
            record = workerenv.read_progress(path.read_bytes) if path.exists() else None
            pid = record.pid if record else pids.get(rank)
            state = "exited" if rank not in pids else _state(pid)
            out.append(view_of(record, rank=rank, host=self.host, state=state, now=now))
        return out

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
            self._send({"ranks": [v.to_json() for v in views], "stacks": stacks(targets),
                        "probe": body.get("probe")})

        threading.Thread(target=answer, name="progress-probe", daemon=True).start()

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _state(pid: int | None) -> str:
    """``stopped`` for a process in state T (SIGSTOP) or t (traced), else running."""
    if not pid:
        return "running"
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "running"
    return "stopped" if stat.rpartition(")")[2].split()[0] in ("T", "t") else "running"


def py_spy() -> str | None:
    """py-spy from PATH or next to this interpreter (a virtualenv's bin, not always on PATH)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


def stacks(pids: Mapping[int, int]) -> dict[str, str]:
    """rank -> its Python stack (``py-spy dump``), taken in parallel; {} without py-spy."""
    exe = py_spy()
    if exe is None or not pids:
        return {}
    found: dict[str, str] = {}

    def dump(rank: int, pid: int) -> None:
        # --nonblocking reads the process's memory without pausing it, so a stopped rank
        # (SIGSTOP) is read too and a running one is not disturbed.
        try:
            done = subprocess.run([exe, "dump", "--nonblocking", "--pid", str(pid)],
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
