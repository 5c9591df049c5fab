"""A process that imports torch once and forks each rank of the tests' trainer runs from there.

    python -m testbed.forkserver SOCKET     (started by `ForkServer`, one per pytest session)

``import torch`` costs ~2.7 s of CPU per process on a 2-core machine: an 8-rank run paid ~20 s
of CPU before its first line of test code. Here `mpiexec` (or `dtrain launch`'s agent, see
`tests.support.mpi_runs.forked_python`) still starts every rank (its PMI socket, stdio pipes,
signals
and exit codes are its own), but what it starts is
`testbed.forkstub`, which hands its file descriptors and environment to this server; the
server forks, and the fork becomes the rank: it takes the stub's stdio, ``PMI_FD``, environment,
folder and command line, and runs the command's module as ``__main__``, which calls
``MPI_Init`` (mpi4py) over Hydra's PMI socket like any MPICH rank. The rank computes exactly
what a fresh process computes: the server imports only third-party packages (never
``mpi4py.MPI``, so MPI is not initialised before the fork), runs no thread when it forks, and
the fork reseeds the generators a fresh process seeds from the OS (`random`, numpy's global).
Its MPICH sleeps while it waits (``MPIR_CVAR_ENABLE_HEAVY_YIELD``, see `become`).
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STUB = str(Path(__file__).with_name("forkstub.py"))
# What every rank of the tests imports and no rank configures at import time. torch._dynamo
# (~1.5-2.5 s) is what every optimizer's constructor imports; matplotlib.pyplot (~0.5-2 s) what
# the loss, expert-load and timeline plots import (each selects the Agg backend itself first).
PRELOAD = ("torch", "torch._dynamo", "numpy", "mpi4py", "rich.progress", "matplotlib.pyplot")
_SPARE_FD = 256  # received descriptors are parked above this while they move into place


@dataclass(frozen=True)
class Spec:
    argv: list[str]      # ["-m", module, args...] or [script, args...]
    env: dict[str, str]
    cwd: str
    fds: list[int]       # the numbers the stub had them under: 0, 1, 2, PMI_FD
    received: list[int]  # the same descriptors as this process received them


def _receive(conn: socket.socket) -> Spec:
    head, fds, _, _ = socket.recv_fds(conn, 4, maxfds=8)
    (size,) = struct.unpack("!I", head)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise EOFError("the stub closed the connection mid-request")
        body += chunk
    spec: dict[str, Any] = json.loads(body)
    return Spec(spec["argv"], spec["env"], spec["cwd"], spec["fds"], fds)


def _single_threaded() -> bool:
    return len(os.listdir("/proc/self/task")) == 1


def serve(path: str) -> Spec:
    """Fork a rank per stub that connects; returns only in a fork, with what it must become."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # the client waits for this name: bound and listening
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    ranks: dict[int, socket.socket] = {}  # pid -> the connection of the stub it stands for
    try:
        while True:
            for key, _ in sel.select(timeout=0.05):
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    spec = _receive(conn)
                    if not _single_threaded() or "mpi4py.MPI" in sys.modules:
                        sys.exit("forkserver: cannot fork a clean rank (threads or MPI started)")
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        sel.close()
                        listener.close()
                        conn.close()
                        for other in ranks.values():
                            other.close()
                        return spec
                    for fd in spec.received:
                        os.close(fd)
                    conn.sendall(f"pid {pid}\n".encode())
                    sel.register(conn, selectors.EVENT_READ, pid)
                    ranks[pid] = conn
                elif not key.fileobj.recv(1):  # type: ignore[union-attr]
                    # The stub is gone (Hydra killed it): its rank must not outlive it.
                    sel.unregister(key.fileobj)
                    os.kill(key.data, signal.SIGKILL)
            _reap(ranks, sel)
    finally:
        if os.getpid() == _SERVER_PID:
            for pid in ranks:
                os.kill(pid, signal.SIGKILL)


def _reap(ranks: dict[int, socket.socket], sel: selectors.BaseSelector) -> None:
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = ranks.pop(pid)
        if conn in (key.fileobj for key in sel.get_map().values()):
            sel.unregister(conn)
            try:
                conn.sendall(f"status {status}\n".encode())
            except OSError:
                pass  # the stub died in the meantime; nobody waits for this status
        conn.close()


def become(spec: Spec) -> None:
    """In the fork: take the stub's descriptors, environment and folder, as a fresh rank."""
    parked = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _SPARE_FD) for fd in spec.received]
    for fd in spec.received:
        os.close(fd)
    for src, dst in zip(parked, spec.fds, strict=True):
        os.dup2(src, dst, inheritable=True)
        os.close(src)
    # Hydra starts every rank in a session of its own; so does this (and with autogroup
    # scheduling a session is a scheduling group: ranks sharing one would share its CPU).
    os.setsid()
    os.chdir(spec.cwd)
    os.environ.clear()
    os.environ.update(spec.env)
    # The tests run up to 8 ranks on 2 cores, and MPICH's waiting ranks spin: among 7 waiting
    # ranks, 1 CPU-s of one rank's work took 4 s. With heavy yield a waiting rank sleeps
    # (nanosleep) every 1000 polls instead; what any rank computes is unchanged.
    os.environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import random

    import numpy

    random.seed()
    numpy.random.seed()


def run(spec: Spec) -> None:
    if spec.argv[0] == "-m":
        sys.argv = spec.argv[1:]
        runpy.run_module(spec.argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(spec.argv)
        runpy.run_path(spec.argv[0], run_name="__main__")


class ForkServer:
    """One server for the session: `command` wraps a rank's command line for `mpiexec`."""

    def __init__(self, env: dict[str, str], timeout: float = 120) -> None:
        self._dir = tempfile.mkdtemp(prefix="dtrain-forkserver-")
        self.path = os.path.join(self._dir, "sock")
        self._log = open(os.path.join(self._dir, "log"), "wb")  # noqa: SIM115 - closed in close
        self.proc = subprocess.Popen([sys.executable, "-m", "testbed.forkserver", self.path],
                                     cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the fork server did not start: {self.log()}")
            time.sleep(0.05)

    def command(self, args: list[str]) -> list[str]:
        return [sys.executable, "-S", STUB, self.path, *args]

    def log(self) -> str:
        return Path(self._dir, "log").read_text(errors="replace")[-4000:]

    def close(self) -> None:
        """Stop the server by its PID; it kills the ranks it forked and still runs."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)


_SERVER_PID = os.getpid()

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # runs `serve`'s cleanup
    for name in PRELOAD:
        importlib.import_module(name)
    run_spec = serve(sys.argv[1])
    become(run_spec)
    run(run_spec)
