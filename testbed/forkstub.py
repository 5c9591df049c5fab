"""What `mpiexec` (or `dtrain launch`'s agent) starts as each rank of a test's trainer run when a
fork server serves the session.

    mpiexec -n 4 python -S testbed/forkstub.py SOCKET -m tests.support.mpi_worker TARGET OUT

Standard library only (``-S``: no site-packages), so it starts in milliseconds. It hands its
stdin, stdout, stderr, its PMI socket (``PMI_FD``), environment, working folder and command
to the fork server (`testbed.forkserver`), whose fork becomes the rank: a real MPICH process
that calls ``MPI_Init`` over that PMI socket, with torch already imported. The stub forwards
SIGINT/SIGTERM/SIGHUP to the rank and exits as the rank exited; if the stub dies, the server
kills the rank, so Hydra's view of its processes stays true.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
from collections.abc import Callable


def forwarder(child: int) -> Callable[[int, object], None]:
    """The stub's handler of a signal: the same signal to the rank. A signal that comes after
    the rank ended (the launcher stopping the job while the rank's status is on its way) is
    not an error: the stub exits with that status as usual."""

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    return forward


def main(path: str, argv: list[str]) -> None:
    fds = [0, 1, 2]
    if "PMI_FD" in os.environ:
        fds.append(int(os.environ["PMI_FD"]))
    spec = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
                       "fds": fds}).encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    socket.send_fds(sock, [struct.pack("!I", len(spec))], fds)
    sock.sendall(spec)
    replies = sock.makefile("r")
    child = int(replies.readline().split()[1])  # "pid N"
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forwarder(child))
    line = replies.readline()  # "status S" (os.waitpid's status), or EOF if the server died
    if not line:
        sys.exit("forkstub: the fork server closed the connection before the rank ended")
    status = int(line.split()[1])
    if os.WIFSIGNALED(status):
        killed_by = os.WTERMSIG(status)
        if killed_by != signal.SIGKILL:  # SIGKILL has no handler to reset (signal() refuses it)
            signal.signal(killed_by, signal.SIG_DFL)
        os.kill(os.getpid(), killed_by)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
