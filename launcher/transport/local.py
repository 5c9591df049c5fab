"""The agent as a local subprocess: localhost hosts (`make run`, CI smoke runs) need no sshd.

Same agent, same frames, same code path as a remote host; only the byte stream differs.
If the head dies, the pipe closes and the agent stops its ranks (EOF), exactly as over SSH.
"""

from __future__ import annotations

import collections
import io
import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from launcher.errors import DtrainError
from launcher.transport.stream import AgentConnection

if TYPE_CHECKING:
    from launcher.errors import ConnectError
    from launcher.hosts.hostfile import HostEntry
    from launcher.transport.options import SSHOptions
    from launcher.transport.stream import AgentStream
    from launcher.transport.table import Opened

AGENT_MODULE = "launcher.agent"

#: The interpreter options of every process that runs dtrain's own code (the agent, the mpirun
#: rank shim, the launch of `dtrain check --perf`), which starts in a directory dtrain does not
#: control (the launch directory, a login's). `-m` would put that directory first on sys.path,
#: so a `launcher/` or `workerenv.py` there would run instead of dtrain's: -P leaves it out, and
#: -E ignores PYTHONPATH, whose empty or relative entries (`PYTHONPATH=$PYTHONPATH:/x` with
#: none set gives ":/x") are that directory again. dtrain is found where it is installed: the
#: interpreter's site-packages with their .pth entries (absolute: an editable install's
#: source folder) and the user's site-packages (`pip install --user`). docs/design.md, 1.
OWN_CODE_OPTIONS = ("-E", "-P")


def python_module(python: str, module: str, *options: str) -> list[str]:
    """``python`` running dtrain's ``module`` with OWN_CODE_OPTIONS (and ``options``)."""
    return [python, *OWN_CODE_OPTIONS, *options, "-m", module]


def agent_command(python: str) -> list[str]:
    """The constant agent command: the interpreter, then `-m launcher.agent`, nothing else."""
    return python_module(python, AGENT_MODULE, "-u")


def start_agents(entries: Sequence[HostEntry], *, python: str, opts: SSHOptions,
                 opened: Opened | None = None) -> list[AgentStream | ConnectError]:
    """The table's `local` row: one agent subprocess per loopback host (``opts`` unused),
    each told to ``opened`` as it starts."""
    streams: list[AgentStream | ConnectError] = []
    for index, entry in enumerate(entries):
        stream = LocalAgentStream(entry.name, python=python)
        if opened is not None:
            opened(index, stream)
        streams.append(stream)
    return streams


class LocalAgentStream:
    """AgentStream over the stdin/stdout pipes of a local agent process."""

    is_local = True
    connection: AgentConnection | None = None  # no SSH in between

    def __init__(self, host: str, python: str = sys.executable, cwd: str | None = None,
                 extra_args: Sequence[str] = (), *, command: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        """``command`` replaces the agent command when a launcher starts it (`srun ...`)."""
        self.host = host
        self._proc = subprocess.Popen(
            list(command) if command else agent_command(python) + list(extra_args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            # Its own session: a terminal's Ctrl-C reaches the head, which decides what to do.
            start_new_session=True,
        )
        self._stderr: collections.deque[str] = collections.deque(maxlen=200)
        self._aborted = False
        self._fd = -1  # stdout's descriptor once the pump reads it (`reader_fd`)
        self._stderr_reader = threading.Thread(target=self._collect_stderr, daemon=True)
        self._stderr_reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def write(self, data: bytes) -> None:
        if self._proc.stdin is None or self._proc.stdin.closed:
            raise OSError(f"the stream to the agent on {self.host} is closed")
        self._proc.stdin.write(data)
        self._proc.stdin.flush()

    def read(self, max_bytes: int = 65536) -> bytes:
        stdout = self._proc.stdout
        # Popen's default buffering makes the pipe a BufferedReader, whose read1 returns what
        # has arrived instead of waiting for max_bytes (typeshed only says IO[bytes]).
        if self._aborted or not isinstance(stdout, io.BufferedReader):
            return b""
        data = stdout.read1(max_bytes)
        self._arrived(data)
        return data

    def reader_fd(self) -> int:
        """The agent's stdout, read without blocking from now on (`read_ready`): only the
        head's pump reads it then (`launcher.transport.pump`)."""
        if self._proc.stdout is None:
            raise OSError(f"the stream to the agent on {self.host} has no stdout")
        fd = self._proc.stdout.fileno()
        os.set_blocking(fd, False)
        self._fd = fd
        return fd

    def read_ready(self, max_bytes: int = 65536) -> bytes | None:
        """What the pipe holds now (`transport.stream.Selectable`)."""
        if self._aborted:
            return b""
        try:
            data = os.read(self._fd, max_bytes)
        except BlockingIOError:
            return None
        self._arrived(data)
        return data

    def _arrived(self, data: bytes) -> None:
        """Bytes came off the stream (the first says the connection works: `transport.openssh`,
        `launcher.slurm`)."""

    def close(self) -> None:
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        except OSError:
            pass

    def abort(self) -> None:
        """EOF to the agent (it stops its ranks) and no more reading; the pipe is not closed
        under a reader thread, which may still be blocked in `read`."""
        self._aborted = True
        self.close()

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """Last resort when the agent does not leave after BYE and EOF."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def stderr_text(self) -> str:
        """The agent's last 200 stderr lines."""
        return "".join(self._stderr)

    def transport_error(self) -> DtrainError | None:
        """None: a pipe does not fail on its own (`transport.openssh` overrides this)."""
        return None

    def _collect_stderr(self) -> None:
        if self._proc.stderr is None:
            return
        for raw in self._proc.stderr:
            self._stderr.append(raw.decode("utf-8", errors="replace"))
