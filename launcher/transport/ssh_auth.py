"""The SSH handshake with one resolved host: host-key check, public-key authentication.

`handshake` verifies the host key with OpenSSH semantics (`launcher.transport.host_keys`) and
authenticates with public keys only (`PublicKeyAuth`: ssh-agent, then IdentityFile or the
default ``~/.ssh/id_*``; never a password or keyboard prompt). Every failure becomes a
`ConnectError` (exit code 255) whose ``where`` is ``user@host:port``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator
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
from launcher.transport import host_keys, ssh_sockets
from launcher.transport.options import SSHOptions
from launcher.transport.ssh_config import ResolvedHost

# paramiko DEBUG/INFO carries fingerprints and auth chatter; users opt in with --debug-ssh.
# Its transport thread also logs a traceback at ERROR for every failed handshake, which
# ConnectError already explains: without a handler configured by the application those would
# reach stderr through logging's last-resort handler, so give the logger a NullHandler.
logging.getLogger("paramiko").setLevel(logging.WARNING)
logging.getLogger("paramiko").addHandler(logging.NullHandler())



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



def handshake(client: paramiko.SSHClient, sock: ssh_sockets.Carrier, host: ResolvedHost,
               opts: SSHOptions, auth: PublicKeyAuth) -> None:
    """Verify the host key and authenticate over an open socket."""
    host_keys.load_into(client.get_host_keys(), host.read_known_hosts)
    client.set_missing_host_key_policy(host_keys.KnownHostsPolicy(
        known_hosts=host.known_hosts, read_from=host.read_known_hosts,
        accept_new=opts.accept_new, where=host.where, host=host.hostname, port=host.port))
    client.connect(host.hostname, port=host.port, username=host.user, sock=sock,
                   timeout=opts.handshake_timeout, banner_timeout=opts.banner_timeout,
                   auth_timeout=opts.auth_timeout, auth_strategy=auth)


def shutdown(client: paramiko.SSHClient, sock: ssh_sockets.Carrier | None) -> None:
    """Close the transport, wait for its thread, then the socket (and reap a ProxyCommand).

    The order matters for ProxyCommand: paramiko's thread closes it by ``kill(pid)``, so the
    process may be reaped (its PID freed) only after that thread is gone. Over a plain socket
    or a jump host's channel nothing waits on that thread (its socket poll takes up to
    `ssh_sockets.IDLE_POLL_S`, which every launch would add to its exit); a TCP socket is shut
    first, so that thread's read ends at once.
    """
    transport = client.get_transport()
    if sock is not None:
        ssh_sockets.shut(sock)
    client.close()
    if transport is not None and isinstance(sock, paramiko.ProxyCommand):
        transport.join(5)
    if sock is not None:
        ssh_sockets.close(sock)
