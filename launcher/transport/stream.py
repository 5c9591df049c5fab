"""The byte stream to one per-host agent, whatever carries it (a pipe or an SSH channel).

The supervisor only ever sees this protocol; `transport.local` (subprocess), `transport.ssh`
(paramiko channel) and `transport.openssh` (an `ssh` process) implement it. The agent command
at the other end is a constant (`<python> -m launcher.agent`); the job itself travels as data
in frames (launcher.wire).
"""

from __future__ import annotations

from typing import Protocol

from launcher.errors import DtrainError


class AgentConnection(Protocol):
    """The connection a remote agent's stream runs over (one SSH connection per host)."""

    @property
    def latency_ms(self) -> float:
        """Connect-to-authenticated time, for `dtrain check`."""

    def peer_address(self) -> str:
        """The address the head reached the host at (rank 0's route towards the others)."""

    def close(self) -> None:
        """Close the connection and every channel on it; idempotent."""


class AgentStream(Protocol):
    """A bidirectional byte stream to an agent process."""

    host: str

    @property
    def is_local(self) -> bool:
        """True when the agent runs on the head's own host (a subprocess, no SSH)."""

    @property
    def connection(self) -> AgentConnection | None:
        """The SSH connection the stream runs over; None for a local agent."""

    def write(self, data: bytes) -> None:
        """Send all of ``data``; raises OSError when the stream is gone."""

    def read(self, max_bytes: int = 65536) -> bytes:
        """Block until some bytes arrive; ``b""`` means the stream closed."""

    def close(self) -> None:
        """Close our end (the agent sees EOF on stdin and stops its ranks); idempotent."""

    def abort(self) -> None:
        """Close both directions at once: nothing more will be read (a host given up on)."""

    def wait(self, timeout: float | None = None) -> int | None:
        """The agent's exit status, or None if it has not exited within ``timeout``."""

    def kill(self) -> None:
        """Last resort when the agent does not leave after BYE and EOF."""

    def stderr_text(self) -> str:
        """The last of what the agent wrote to stderr (its startup traceback, for errors)."""

    def transport_error(self) -> DtrainError | None:
        """Why the stream closed before the agent spoke when the transport itself failed
        (an `ssh` process's own error); None otherwise (the agent's stderr tells)."""


class Selectable(Protocol):
    """A stream the head reads with one thread for all (`launcher.transport.pump`), not a thread
    of its own: a descriptor to poll, and a read that never blocks."""

    def reader_fd(self) -> int:
        """A descriptor that polls readable when `read_ready` has bytes or the stream ended.
        From this call on only `read_ready` reads the stream."""

    def read_ready(self, max_bytes: int = 65536) -> bytes | None:
        """Without blocking: what arrived, ``b""`` once the stream ended, None when there
        is nothing yet."""
