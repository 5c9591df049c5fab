"""The byte stream to one per-host agent, whatever carries it (a pipe or an SSH channel).

The supervisor only ever sees this protocol; `transport.local` (subprocess) and
`transport.ssh` (paramiko channel) implement it. The agent command at the other end is a constant
(`<python> -m launcher.agent`); the job itself travels as data in frames (launcher.wire).
"""

from __future__ import annotations

from typing import Protocol


class AgentStream(Protocol):
    """A bidirectional byte stream to an agent process."""

    host: str

    def write(self, data: bytes) -> None:
        """Send all of ``data``; raises OSError when the stream is gone."""

    def read(self, max_bytes: int = 65536) -> bytes:
        """Block until some bytes arrive; ``b""`` means the stream closed."""

    def close(self) -> None:
        """Close our end (the agent sees EOF on stdin and stops its ranks); idempotent."""

    def wait(self, timeout: float | None = None) -> int | None:
        """The agent's exit status, or None if it has not exited within ``timeout``."""
