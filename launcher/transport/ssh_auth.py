"""Reaching one resolved host: TCP connect or jump-host tunnel, host-key check, public-key auth.

`handshake` verifies the host key with OpenSSH semantics (`launcher.transport.host_keys`) and
authenticates with public keys only (`PublicKeyAuth`: ssh-agent, then IdentityFile or the
default ``~/.ssh/id_*``; never a password or keyboard prompt). Every failure becomes a
`ConnectError` (exit code 255) whose ``where`` is ``user@host:port``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path

import paramiko
from paramiko.auth_strategy import (
    AuthFailure,
    AuthSource,
    AuthStrategy,
    InMemoryPrivateKey,
    OnDiskPrivateKey,
    SourceResult,
)

from launcher.errors import ConnectError
from launcher.transport import host_keys
from launcher.transport.options import SSHOptions
from launcher.transport.ssh_config import ResolvedHost

# paramiko DEBUG/INFO carries fingerprints and auth chatter; users opt in with --debug-ssh.
# Its transport thread also logs a traceback at ERROR for every failed handshake, which
# ConnectError already explains: without a handler configured by the application those would
# reach stderr through logging's last-resort handler, so give the logger a NullHandler.
logging.getLogger("paramiko").setLevel(logging.WARNING)
logging.getLogger("paramiko").addHandler(logging.NullHandler())

#: What an SSH transport runs over: TCP, a jump host's tunnel, or a ProxyCommand's pipes.
Carrier = socket.socket | paramiko.Channel | paramiko.ProxyCommand


# ---------------------------------------------------------------- authentication


def _public_blob(path: str, key: paramiko.PKey | None) -> str | None:
    """The base64 public key of an identity file (from the key or its ``.pub``)."""
    if key is not None:
        return key.get_base64()
    try:
        fields = Path(path + ".pub").read_text().split()
    except OSError:
        return None
    return fields[1] if len(fields) >= 2 else None


def _load_identity(path: str) -> tuple[paramiko.PKey | None, str]:
    """(key, note); note says why a file cannot be offered without prompting."""
    try:
        return paramiko.PKey.from_path(path), "rejected"
    except FileNotFoundError:
        return None, "not found"
    except TypeError:  # cryptography: "Password was not given but private key is encrypted"
        return None, "passphrase-protected: load it into ssh-agent"
    except paramiko.PasswordRequiredException:
        return None, "passphrase-protected: load it into ssh-agent"
    except (OSError, ValueError, paramiko.SSHException) as exc:
        return None, f"unusable: {exc}"


def _agent() -> paramiko.Agent | None:
    """The ssh-agent, or None when SSH_AUTH_SOCK is unset or dead (not an error: no keys).

    Probed first because paramiko leaks its socket when the agent's socket refuses.
    """
    path = os.environ.get("SSH_AUTH_SOCK")
    if not path:
        return None
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except OSError:
            return None
    return paramiko.Agent()


class PublicKeyAuth(AuthStrategy):
    """publickey only, in OpenSSH's order: agent keys, then identity files (BatchMode-like)."""

    def __init__(self, host: ResolvedHost) -> None:
        super().__init__(ssh_config=paramiko.SSHConfig())  # unused: the host is resolved
        self.host = host
        self.tried: list[str] = []
        self._agent: paramiko.Agent | None = None

    def get_sources(self) -> Iterator[AuthSource]:
        files = [(path, *_load_identity(path)) for path in self.host.identity_files]
        wanted = {_public_blob(path, key) for path, key, _ in files}
        offered = set()
        for agent_key in self._agent.get_keys() if self._agent else ():
            if self.host.identities_only and agent_key.get_base64() not in wanted:
                continue
            offered.add(agent_key.get_base64())
            self.tried.append(f"agent key {host_keys.fingerprint(agent_key)} (rejected)")
            yield InMemoryPrivateKey(self.host.user, agent_key)
        for path, key, note in files:
            if key is not None and key.get_base64() in offered:
                continue
            self.tried.append(f"{path} ({note})")
            if key is not None:
                yield OnDiskPrivateKey(self.host.user, "ssh-config", Path(path), key)

    def authenticate(self, transport: paramiko.Transport) -> list[SourceResult]:
        # Last host-key check before we sign anything: paramiko ignores @revoked lines.
        host_keys.check_not_revoked(self.host.key_name, transport.get_remote_server_key(),
                                   self.host.read_known_hosts, self.host.where)
        self._agent = _agent()
        try:
            return super().authenticate(transport)
        finally:
            if self._agent is not None:
                self._agent.close()  # agent keys sign only during authentication


# ---------------------------------------------------------------- connecting


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
    raise ConnectError(f"cannot resolve host name {host.hostname!r}", host.where,
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


def tcp_connect(host: ResolvedHost, keepalive: float) -> socket.socket:
    """A connected socket, all of it (DNS + SYNs) within ``host.connect_timeout``."""
    deadline = time.monotonic() + host.connect_timeout
    last: OSError | None = None
    for family, kind, proto, _, address in _resolve_addresses(host, deadline):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sock = socket.socket(family, kind, proto)
        sock.settimeout(left)
        try:
            sock.connect(address)
        except OSError as exc:
            sock.close()
            last = exc
            continue
        _bound_unacked_data(sock, keepalive)
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


# ---------------------------------------------------------------- handshake


def handshake_error(host: ResolvedHost, exc: BaseException, opts: SSHOptions,
                    auth: PublicKeyAuth) -> ConnectError:
    """The ConnectError explaining a failed handshake; ``auth.tried`` lists the keys offered."""
    what = f"cannot connect to {host.alias}"
    timed_out = "timeout" in str(exc).lower() or (isinstance(exc, AuthFailure) and any(
        "timeout" in str(attempt.result).lower() for attempt in exc.result))
    if isinstance(exc, paramiko.AuthenticationException) and not timed_out:
        tried = "; ".join(auth.tried) or "no key (no agent keys, no identity files)"
        return ConnectError(what, host.where, f"authentication failed (publickey) as "
                            f"{host.user}; tried: {tried}",
                            "Add your public key to the host's authorized_keys, load a "
                            "passphrase-protected key into ssh-agent, or set IdentityFile in "
                            "~/.ssh/config; dtrain never prompts for passwords")
    if isinstance(exc, paramiko.AuthenticationException):
        return ConnectError(what, host.where, f"authentication did not finish within "
                            f"{opts.auth_timeout:g} s", "Check the host's sshd (PAM, slow "
                            "home directory mount)")
    cause = exc.__context__ or exc.__cause__
    if "banner" in str(exc) and isinstance(cause, (TimeoutError, socket.timeout)):
        why = f"no SSH banner within {opts.banner_timeout:g} s (is an SSH server on that port?)"
    elif "banner" in str(exc) or isinstance(exc, EOFError):
        why = ("the server closed the connection during the handshake (sshd MaxStartups "
               "reached, host denied by sshd, or not an SSH server)")
    else:
        why = f"SSH handshake failed within {opts.handshake_timeout:g} s: " \
              f"{exc or type(exc).__name__}"
    return ConnectError(what, host.where, why, "Check sshd on the host and its logs")


_HANDSHAKES_PER_HOST = 8
_handshake_slots: dict[str, threading.BoundedSemaphore] = {}
_slots_lock = threading.Lock()


def handshake_slot(key_name: str) -> threading.BoundedSemaphore:
    """At most 8 concurrent handshakes per endpoint (Hydra's throttle): a jump host shared by
    many targets would otherwise see a burst beyond sshd's MaxStartups (10:30:100)."""
    with _slots_lock:
        return _handshake_slots.setdefault(key_name,
                                           threading.BoundedSemaphore(_HANDSHAKES_PER_HOST))


def is_transient(exc: BaseException) -> bool:
    """A dropped connection before the banner: sshd's MaxStartups throttling, worth a retry."""
    cause = exc.__context__ or exc.__cause__
    return ("banner" in str(exc) and isinstance(cause, (EOFError, ConnectionResetError))) or \
        isinstance(exc, (EOFError, ConnectionResetError))



def handshake(client: paramiko.SSHClient, sock: Carrier, host: ResolvedHost,
               opts: SSHOptions, auth: PublicKeyAuth) -> None:
    """Verify the host key and authenticate over an open socket."""
    host_keys.load_into(client.get_host_keys(), host.read_known_hosts)
    client.set_missing_host_key_policy(host_keys.KnownHostsPolicy(
        known_hosts=host.known_hosts, read_from=host.read_known_hosts,
        accept_new=opts.accept_new, where=host.where, host=host.hostname, port=host.port))
    client.connect(host.hostname, port=host.port, username=host.user, sock=sock,
                   timeout=opts.handshake_timeout, banner_timeout=opts.banner_timeout,
                   auth_timeout=opts.auth_timeout, auth_strategy=auth)


def shutdown(client: paramiko.SSHClient, sock: Carrier | None) -> None:
    """Close the transport, wait for its thread, then the socket (and reap a ProxyCommand).

    The order matters for ProxyCommand: paramiko's thread closes it by ``kill(pid)``, so the
    process may be reaped (its PID freed) only after that thread is gone.
    """
    transport = client.get_transport()
    client.close()
    if transport is not None:
        transport.join(5)
    if sock is not None:
        _close_socket(sock)


def _close_socket(sock: Carrier) -> None:
    """Close a socket, channel or ProxyCommand; a ProxyCommand's process is also reaped."""
    with contextlib.suppress(OSError):
        sock.close()
    if isinstance(sock, paramiko.ProxyCommand):
        try:
            sock.process.wait(5)
        except subprocess.TimeoutExpired:
            sock.process.kill()
            sock.process.wait()

