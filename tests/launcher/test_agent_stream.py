"""Every member of the AgentStream protocol on both transports: a local agent and SSH."""

from __future__ import annotations

import signal
import time

from launcher.transport.local import LocalAgentStream
from launcher.transport.ssh import SSHConnection, SSHOptions, resolve_host


def test_a_local_agent_stream_is_local_and_abort_ends_it():
    stream = LocalAgentStream("localhost")
    try:
        assert stream.is_local and stream.connection is None
        stream.abort()
        assert stream.read() == b""
        assert stream.wait(15) == 1  # EOF without BYE: the agent leaves on its own, non-zero
        assert stream.stderr_text() == ""
    finally:
        stream.kill()


def test_killing_a_local_agent_stream_stops_its_process():
    stream = LocalAgentStream("localhost")
    try:
        stream.kill()
        assert stream.wait(0) == -signal.SIGKILL
    finally:
        stream.kill()


def test_an_ssh_agent_stream_knows_its_connection_and_kill_ends_the_command(sshd):
    opts = SSHOptions(config_file=sshd.ssh_config)
    conn = SSHConnection.open(resolve_host("loopback", user=None, port=None, opts=opts), opts)
    try:
        stream = conn.exec_stream("echo starting >&2; exec cat")
        assert not stream.is_local and stream.connection is conn
        assert conn.peer_address() == sshd.host and conn.latency_ms > 0
        # sshd reads the command's stdout and stderr from two pipes and may forward cat's
        # echo before the earlier stderr line; a killed channel drops what arrives after it,
        # so the stderr line is awaited first.
        deadline = time.monotonic() + 30
        while "starting" not in stream.stderr_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "starting" in stream.stderr_text()
        stream.write(b"ping\n")
        assert stream.read() == b"ping\n"
        stream.kill()
        assert stream.read() == b""
        assert "starting" in stream.stderr_text()
    finally:
        conn.close()
