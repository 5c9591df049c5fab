"""SSH transport: one paramiko connection per host, carrying one agent session.

The head resolves each host through the ssh config (`ssh_config.resolve_host`), opens a
connection per host (bounded parallelism, `open_all`), verifies the host key and authenticates
with public keys only (`ssh_auth`), and runs the constant agent command in one session channel
(`SSHConnection.exec_stream`, an `SSHAgentStream`).

Layers, each importing only the ones before it: ``ssh_config`` (what to connect to) <-
``ssh_sockets`` (TCP, tunnels) <- ``ssh_auth`` (host keys, authentication) <- ``ssh``
(connections and channels). The names callers use (`SSHOptions` from ``options``,
`ResolvedHost`, `resolve_host`, `resolve_hosts`) are re-exported here.

Every failure is a `ConnectError` (exit code 255) whose ``where`` is ``user@host:port``.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import paramiko

from launcher.errors import ConnectError
from launcher.transport import host_keys, ssh_auth, ssh_sockets
from launcher.transport.options import SSHOptions
from launcher.transport.ssh_config import ResolvedHost, resolve_host, resolve_hosts

__all__ = ["ResolvedHost", "SSHAgentStream", "SSHConnection", "SSHOptions", "open_all",
           "resolve_host", "resolve_hosts"]

_STDERR_KEEP = 64 * 1024


def _open_socket(host: ResolvedHost, opts: SSHOptions,
                 jump: SSHConnection | None) -> ssh_sockets.Carrier:
    """What the SSH transport runs over: a tunnel via the jump host, ProxyCommand or TCP."""
    if jump is not None:
        return ssh_sockets.tunnel(host, jump.host, jump.transport)
    if host.proxy_command:
        return paramiko.ProxyCommand(host.proxy_command)
    return ssh_sockets.tcp_connect(host, opts.keepalive)


class SSHConnection:
    """An authenticated connection to one host; channels are opened on it."""

    #: Its close waits for paramiko's transport thread: `close_streams` closes many at once.
    slow_close = True

    def __init__(self, host: ResolvedHost, client: paramiko.SSHClient, latency_ms: float,
                 opts: SSHOptions, jump: SSHConnection | None = None,
                 sock: ssh_sockets.Carrier | None = None) -> None:
        self.host, self.latency_ms = host, latency_ms
        self._client, self._opts, self._jump, self._sock = client, opts, jump, sock

    @classmethod
    def open(cls, host: ResolvedHost, opts: SSHOptions) -> SSHConnection:
        """Connect, verify the host key and authenticate; raises ConnectError/HostKeyError.

        A connection dropped before the banner (sshd's MaxStartups throttling a burst of
        handshakes, e.g. on a shared jump host) is retried twice with jittered backoff.
        ``latency_ms`` covers TCP connect (and jump hosts) through authentication.
        """
        attempt = 0
        while True:
            try:
                return cls._open_once(host, opts)
            except _Retry as retry:
                attempt += 1
                if attempt == 3:
                    raise retry.error from None
                time.sleep(0.25 * 2 ** attempt + random.uniform(0, 0.25))

    @classmethod
    def _open_once(cls, host: ResolvedHost, opts: SSHOptions) -> SSHConnection:
        start = time.monotonic()
        jump = cls.open(host.jump, opts) if host.jump else None
        client, auth = paramiko.SSHClient(), ssh_auth.PublicKeyAuth(host)
        sock: ssh_sockets.Carrier | None = None
        try:
            with ssh_auth.handshake_slot(host.key_name):
                sock = _open_socket(host, opts, jump)
                ssh_auth.handshake(client, sock, host, opts, auth)
        except BaseException as exc:
            ssh_auth.shutdown(client, sock)
            if jump is not None:
                jump.close()
            if isinstance(exc, ConnectError):
                raise
            if isinstance(exc, paramiko.BadHostKeyException):
                raise host_keys.changed_key_error(host.key_name, exc.key, exc.expected_key,
                                                 host.read_known_hosts, host.where) from None
            if not isinstance(exc, Exception):
                raise
            error = ssh_auth.handshake_error(host, exc, opts, auth)
            if ssh_auth.is_transient(exc):
                raise _Retry(error) from None
            raise error from None
        connection = cls(host, client, (time.monotonic() - start) * 1000.0, opts, jump, sock)
        connection.transport.set_keepalive(max(1, int(opts.keepalive)))
        if isinstance(sock, socket.socket):  # paramiko's thread polls its socket this often
            sock.settimeout(ssh_sockets.IDLE_POLL_S)
        return connection

    @property
    def transport(self) -> paramiko.Transport:
        """The live paramiko transport (for port forwards); ConnectError when it is gone."""
        transport = self._client.get_transport()
        if transport is None or not transport.is_active():
            raise ConnectError(f"connection to {self.host.alias} lost", self.host.where,
                               "the SSH transport is closed", "Check the host and network")
        return transport

    def exec_stream(self, command: str) -> SSHAgentStream:
        """Run ``command`` in one session channel, without a pty (binary-clean stdin/stdout)."""
        where, what = self.host.where, f"cannot start a command on {self.host.alias}"
        try:
            channel = self.transport.open_session(timeout=self._opts.channel_timeout)
        except paramiko.ChannelException as exc:
            raise ConnectError(what, where, f"the server refused a new session ({exc.text})",
                               "sshd's MaxSessions may be exhausted; raise it") from None
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise ConnectError(what, where, f"the connection failed: {exc}",
                               "Check the host and network") from None
        try:
            channel.exec_command(command)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            channel.close()
            raise ConnectError(what, where, f"the server refused the exec request: {exc}",
                               "Check sshd's ForceCommand/restrictions for this user") from None
        return SSHAgentStream(self.host.alias, channel, self)

    def peer_address(self) -> str:
        """The host's address as the head reached it: the TCP peer; behind a jump host or a
        ProxyCommand, its HostName (resolved here when it can be)."""
        if isinstance(self._sock, socket.socket):
            with contextlib.suppress(OSError):
                return str(self._sock.getpeername()[0])
        with contextlib.suppress(OSError):
            return str(socket.getaddrinfo(self.host.hostname, None,
                                          type=socket.SOCK_STREAM)[0][4][0])
        return self.host.hostname

    def run(self, command: str, timeout: float) -> tuple[int, bytes, bytes]:
        """(exit code, stdout, stderr) of a short command with stdin closed (like ``ssh -n``).

        The code is 255 when the server reports none (killed by a signal), as ssh(1) does.
        """
        stream = self.exec_stream(command)
        deadline = time.monotonic() + timeout
        out = bytearray()
        try:
            stream.close()
            while chunk := stream.read_until(deadline):
                out += chunk
            code = stream.wait(max(0.0, deadline - time.monotonic()))
            if code is None and not stream.exited():
                raise TimeoutError()
        except TimeoutError:
            raise ConnectError(f"remote command timed out on {self.host.alias}", self.host.where,
                               f"`{command}` did not finish within {timeout:g} s",
                               "Check the host for a hung process or load") from None
        finally:
            stream.abort()
        return (255 if code is None else code), bytes(out), stream.stderr_bytes()

    def close(self) -> None:
        """Close the transport (every channel on it) and the jump host's; idempotent."""
        ssh_auth.shutdown(self._client, self._sock)
        self._sock = None
        if self._jump is not None:
            self._jump.close()


class _Retry(Exception):
    def __init__(self, error: ConnectError) -> None:
        super().__init__(str(error))
        self.error = error


class SSHAgentStream:
    """`launcher.transport.stream.AgentStream` over a paramiko session channel.

    stderr is drained by a thread into a bounded buffer: paramiko shares one flow-control
    window between stdout and stderr, so an undrained stderr would stall stdout (and the
    agent prints its startup traceback there, which `stderr_text` exposes for error messages).
    """

    is_local = False

    def __init__(self, host: str, channel: paramiko.Channel, connection: SSHConnection) -> None:
        self.host = host
        self.connection = connection
        self._channel = channel
        self._stderr = bytearray()
        self._lock = threading.Lock()
        self._drain = threading.Thread(target=self._drain_stderr, daemon=True,
                                       name=f"ssh-stderr-{host}")
        self._drain.start()

    def _drain_stderr(self) -> None:
        while True:
            try:
                data = self._channel.recv_stderr(65536)
            except TimeoutError:
                continue
            except (OSError, EOFError, paramiko.SSHException):
                return
            if not data:
                return
            with self._lock:
                self._stderr += data
                del self._stderr[:-_STDERR_KEEP]

    def write(self, data: bytes) -> None:
        offset = 0
        while offset < len(data):
            try:
                sent = self._channel.send(data[offset:offset + 32768])
            except (paramiko.SSHException, EOFError) as exc:
                raise OSError(f"SSH channel to {self.host} failed: {exc}") from None
            if sent == 0:  # paramiko returns 0 forever after EOF was sent or the peer closed
                raise OSError(f"SSH channel to {self.host} is closed")
            offset += sent

    def read(self, max_bytes: int = 65536) -> bytes:
        try:
            return self._channel.recv(max_bytes)
        except (OSError, EOFError, paramiko.SSHException):
            return b""

    def reader_fd(self) -> int:
        """paramiko's pipe for the channel: readable while stdout (or stderr, which the
        drain thread empties) holds bytes, and for good once the channel ended."""
        return int(self._channel.fileno())

    def read_ready(self, max_bytes: int = 65536) -> bytes | None:
        """What stdout holds now (`transport.stream.Selectable`); None while only stderr
        woke the pipe."""
        channel = self._channel
        if channel.recv_ready() or channel.eof_received or channel.closed:
            return self.read(max_bytes)
        return None

    def read_until(self, deadline: float, max_bytes: int = 65536) -> bytes:
        """`read` that raises socket.timeout at ``deadline`` (monotonic clock)."""
        self._channel.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            return self._channel.recv(max_bytes)
        finally:
            self._channel.settimeout(None)

    def close(self) -> None:
        """Send EOF (the agent sees stdin close); output and exit status still arrive."""
        try:
            self._channel.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass

    def abort(self) -> None:
        """Close the channel both ways at once (the remote side gets SIGPIPE/EOF)."""
        self._channel.close()

    def kill(self) -> None:
        """Close the channel (no signal is sent): the agent loses stdin and stdout and stops
        its ranks as it does when the head is gone."""
        self.abort()

    def exited(self) -> bool:
        """True once the remote command reported a status or the channel closed."""
        return self._channel.exit_status_ready()

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code; None on timeout and when the server sent none (never paramiko's -1)."""
        if not self._channel.status_event.wait(timeout):
            return None
        code = self._channel.exit_status
        return code if code >= 0 else None

    def stderr_bytes(self) -> bytes:
        self._drain.join(0.5)
        with self._lock:
            return bytes(self._stderr)

    def stderr_text(self) -> str:
        """What the remote side wrote to stderr (the last 64 KiB), decoded leniently."""
        return self.stderr_bytes().decode("utf-8", errors="replace")

    def transport_error(self) -> ConnectError | None:
        """None: paramiko's failures are raised while connecting (`SSHConnection.open`)."""
        return None


def open_all(hosts: Sequence[ResolvedHost],
             opts: SSHOptions) -> list[SSHConnection | ConnectError]:
    """Connect to every host, ``opts.max_parallel`` handshakes at a time; results in order."""

    def one(host: ResolvedHost) -> SSHConnection | ConnectError:
        try:
            return SSHConnection.open(host, opts)
        except ConnectError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 (one host's bug must not lose the others)
            return ConnectError(f"cannot connect to {host.alias}", host.where,
                                f"unexpected {type(exc).__name__}: {exc}", "Report this bug")

    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(opts.max_parallel, len(hosts))),
                            thread_name_prefix="ssh-open") as pool:
        return list(pool.map(one, hosts))

