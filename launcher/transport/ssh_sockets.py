"""What an SSH connection runs over: TCP (DNS and connect bounded by ConnectTimeout, a bound
on unacknowledged data, no Nagle and quick ACKs: docs/design.md §1) or a tunnel through a jump
host; and closing either, or a ProxyCommand.

Every failure becomes a `ConnectError` (exit code 255) whose ``where`` is ``user@host:port``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

import paramiko

from launcher.errors import ConnectError, UnreachableError
from launcher.transport.ssh_config import ResolvedHost

#: What an SSH transport runs over: TCP, a jump host's tunnel, or a ProxyCommand's pipes.
Carrier = socket.socket | paramiko.Channel | paramiko.ProxyCommand

_Addresses = Sequence[tuple[socket.AddressFamily, socket.SocketKind, int, str,
                            tuple[str, int] | tuple[str, int, int, int] | tuple[int, bytes]]]


def _resolve_addresses(host: ResolvedHost, deadline: float) -> _Addresses:
    """getaddrinfo bounded by the connect timeout (a dead DNS server can stall it for long)."""
    found: Future[_Addresses] = Future()

    def lookup() -> None:
        try:
            found.set_result(socket.getaddrinfo(host.hostname, host.port,
                                                type=socket.SOCK_STREAM))
        except OSError as exc:
            found.set_exception(exc)

    threading.Thread(target=lookup, daemon=True, name=f"resolve-{host.hostname}").start()
    try:
        return found.result(timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError:  # the lookup's own errors are never TimeoutError (gaierror)
        why = f"no answer within {host.connect_timeout:g} s"
    except OSError as exc:
        why = str(exc)
    raise UnreachableError(f"cannot resolve host name {host.hostname!r}", host.where,
                       f"name not resolved ({why})", "Check the hostfile entry, /etc/hosts or "
                       "DNS, or set HostName for it in ~/.ssh/config")


def _tcp_error(host: ResolvedHost, exc: OSError | None) -> ConnectError:
    code = getattr(exc, "errno", None)
    if isinstance(exc, ConnectionRefusedError):
        why, fix = (f"connection refused: nothing listens on port {host.port}",
                    "Start sshd on the host or fix the port in the hostfile or ssh config")
    elif code in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        why, fix = (f"no route to host ({os.strerror(code)})",
                    "Check that the host is up and its network link and routes")
    elif exc is None or isinstance(exc, TimeoutError):
        why = (f"TCP connect timed out after {host.connect_timeout:g} s (host down, "
               "firewalled, or packets dropped)")
        fix = ("Check that the host is up and that the SSH port is open; raise "
               "ConnectTimeout for slow networks")
    else:
        why, fix = f"TCP connect failed: {exc}", "Check the host and its network"
        return ConnectError(f"cannot connect to {host.alias}", host.where, why, fix)
    return UnreachableError(f"cannot connect to {host.alias}", host.where, why, fix)


class _PromptSocket(socket.socket):
    """TCP for SSH's back-and-forth of small packets: no Nagle, and every read ACKed at once.

    A launch is a ping-pong of small packets (key exchange, authentication, channel open,
    exec, the agent's frames). sshd turns Nagle off only for pty sessions and Linux delays an
    ACK up to 40 ms, so whenever one side sends two small packets in a row the second waits
    for the delayed ACK of the first. On the namespace cluster this took the handshake from 23
    to 68 ms and the first exec from 2 to 43 ms. Quick-ACK mode is not sticky (the kernel
    leaves it by itself), hence once per read.
    """

    def recv(self, bufsize: int, flags: int = 0, /) -> bytes:
        data = super().recv(bufsize, flags)
        with contextlib.suppress(OSError):  # closed meanwhile: the next recv reports it
            self.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        return data


_SOCKET = _PromptSocket if hasattr(socket, "TCP_QUICKACK") else socket.socket  # Linux only


#: How often an idle connection's paramiko thread wakes (its socket's timeout once connected;
#: paramiko's own is 0.1 s). It wakes only to see whether it was closed and whether a keepalive
#: is due: 64 hosts at 0.1 s were 640 wake-ups a second, each taking the GIL, in a head that on
#: a loaded machine gets a few tens of milliseconds of CPU a second (it then missed its own
#: heartbeats). Closing does not wait for it: `shut` ends its read at once.
IDLE_POLL_S = 1.0


def tcp_connect(host: ResolvedHost, keepalive: float) -> socket.socket:
    """A connected socket, all of it (DNS + SYNs) within ``host.connect_timeout``."""
    deadline = time.monotonic() + host.connect_timeout
    last: OSError | None = None
    for family, kind, proto, _, address in _resolve_addresses(host, deadline):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sock = _SOCKET(family, kind, proto)
        sock.settimeout(left)
        try:
            sock.connect(address)
        except OSError as exc:
            sock.close()
            last = exc
            continue
        _bound_unacked_data(sock, keepalive)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # see _PromptSocket
        return sock
    raise _tcp_error(host, last)


def _bound_unacked_data(sock: socket.socket, keepalive: float) -> None:
    """Drop the connection when sent data stays unacknowledged for 4 keepalive intervals.

    paramiko's keepalive only *sends*; on a silently partitioned link the kernel would keep
    retransmitting for ~15 minutes. With TCP_USER_TIMEOUT the transport fails after ~4
    intervals (60 s by default), the channel reads EOF, and the head learns the host is gone.
    """
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(4000 * keepalive))


def tunnel(host: ResolvedHost, jump: ResolvedHost,
           transport: paramiko.Transport) -> paramiko.Channel:
    """A direct-tcpip channel from the jump host to ``host`` (ProxyJump, OpenSSH's -W)."""
    try:
        return transport.open_channel("direct-tcpip", (host.hostname, host.port),
                                      ("127.0.0.1", 0), timeout=host.connect_timeout)
    except paramiko.ChannelException as exc:
        why = f"the jump host could not open a tunnel to {host.hostname}:{host.port} ({exc.text})"
    except (paramiko.SSHException, EOFError, OSError) as exc:
        why = f"the jump host connection failed while tunnelling: {exc or type(exc).__name__}"
    raise ConnectError(f"cannot connect to {host.alias} via {jump.alias}", host.where, why,
                       "Check that the jump host reaches the target and allows TCP forwarding")


def shut(sock: Carrier) -> None:
    """End a TCP connection both ways now: a thread blocked reading it returns at once (closing
    the descriptor alone would leave it there until its poll, `IDLE_POLL_S`)."""
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def close(sock: Carrier) -> None:
    """Close a socket, channel or ProxyCommand; a ProxyCommand's process is also reaped."""
    with contextlib.suppress(OSError):
        sock.close()
    if isinstance(sock, paramiko.ProxyCommand):
        try:
            sock.process.wait(5)
        except subprocess.TimeoutExpired:
            sock.process.kill()
            sock.process.wait()

