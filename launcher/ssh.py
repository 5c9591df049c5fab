"""SSH transport: one paramiko connection per host, carrying one agent session.

The head opens a connection per host (bounded parallelism, `open_all`), verifies the host key
with OpenSSH semantics (`launcher.hostkeys`), authenticates with public keys only (ssh-agent,
then IdentityFile or the default ``~/.ssh/id_*``; never a password or keyboard prompt), and
runs the constant agent command in one session channel (`SSHConnection.exec_stream`).

``~/.ssh/config`` is read with paramiko's parser (`resolve_host`): Host aliases, HostName,
User, Port, IdentityFile, IdentitiesOnly, UserKnownHostsFile, ConnectTimeout, ProxyJump and
Include (spliced in place, an approximation of OpenSSH's rule). ``ProxyCommand`` and
``Match exec`` run local shell commands, so they are refused unless
``SSHOptions.allow_config_exec``. Explicit ``user``/``port`` arguments win over the config (as
``ssh -l/-p`` do); a config ``ConnectTimeout`` wins over ``SSHOptions.connect_timeout``.

Every failure is a `ConnectError` (exit code 255) whose ``where`` is ``user@host:port``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import getpass
import glob
import logging
import os
import random
import re
import shlex
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import paramiko
from paramiko.auth_strategy import (
    AuthFailure,
    AuthStrategy,
    InMemoryPrivateKey,
    OnDiskPrivateKey,
)

from launcher import hostkeys
from launcher.errors import ConnectError

# paramiko DEBUG/INFO carries fingerprints and auth chatter; users opt in with --debug-ssh.
# Its transport thread also logs a traceback at ERROR for every failed handshake, which
# ConnectError already explains: without a handler configured by the application those would
# reach stderr through logging's last-resort handler, so give the logger a NullHandler.
logging.getLogger("paramiko").setLevel(logging.WARNING)
logging.getLogger("paramiko").addHandler(logging.NullHandler())

_SETTING = re.compile(r"^\s*(\w+)(?:\s*=\s*|\s+)(.+?)\s*$")
_HOST_OK = re.compile(r"^[A-Za-z0-9._:\[\]-]+$")
_USER_OK = re.compile(r"^[A-Za-z0-9._@\\$-]+$")
_DEFAULT_KEYS = ("~/.ssh/id_rsa", "~/.ssh/id_ecdsa", "~/.ssh/id_ed25519")
_MAX_JUMPS = 8
_STDERR_KEEP = 64 * 1024


@dataclass(frozen=True)
class SSHOptions:
    """How to reach hosts; one instance per launch (CLI options map onto these fields)."""

    config_file: Path | None = None      # None -> ~/.ssh/config when it exists
    known_hosts: Path | None = None      # None -> UserKnownHostsFile from config, else ~/.ssh/
    accept_new: bool = False             # opt-in TOFU; a CHANGED key is always refused
    connect_timeout: float = 10.0
    banner_timeout: float = 15.0
    auth_timeout: float = 30.0
    keepalive: float = 15.0
    max_parallel: int = 32               # bounded parallel handshakes
    allow_config_exec: bool = False      # ProxyCommand / Match exec are refused unless True
    handshake_timeout: float = 30.0      # banner + key exchange, whole
    channel_timeout: float = 30.0        # opening a session channel


@dataclass(frozen=True)
class ResolvedHost:
    """A host name after ssh config lookup: everything needed to connect, nothing executed."""

    alias: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    known_hosts: Path                    # where accept_new writes (first UserKnownHostsFile)
    read_known_hosts: tuple[Path, ...] = ()   # every file consulted, global ones included
    identities_only: bool = False
    connect_timeout: float = 10.0
    proxy_command: str | None = None     # only set when allow_config_exec
    jump: ResolvedHost | None = None     # ProxyJump: connect through this host first

    @property
    def key_name(self) -> str:
        """The known_hosts name: ``host`` for port 22, ``[host]:port`` otherwise."""
        return hostkeys.key_name(self.hostname, self.port)

    @property
    def where(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


# ---------------------------------------------------------------- ssh config resolution


def _config_lines(path: Path, depth: int = 0) -> list[tuple[str, str]]:
    """(line, "file:lineno") of a config file with Include directives spliced in."""
    if depth > 16:
        raise ConnectError("ssh config Include nesting too deep", str(path),
                           "more than 16 levels (an Include loop?)", "Fix the Include lines")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConnectError("cannot read ssh config", str(path), str(exc),
                           "Fix the file or pass another with --ssh-config") from None
    lines: list[tuple[str, str]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        match = _SETTING.match(line)
        if not (match and match.group(1).lower() == "include"):
            lines.append((line, f"{path}:{lineno}"))
            continue
        for pattern in shlex.split(match.group(2)):
            full = Path(os.path.expanduser(pattern))
            full = full if full.is_absolute() else Path.home() / ".ssh" / full
            for included in sorted(glob.glob(str(full))):
                lines += _config_lines(Path(included), depth + 1)
    return lines


def _first_directive(lines: list[tuple[str, str]], key: str) -> str | None:
    """The origin of the first line setting ``key`` (for error messages)."""
    for text, origin in lines:
        match = _SETTING.match(text)
        if match and match.group(1).lower() == key:
            return origin
    return None


def _refuse_match_exec(lines: list[tuple[str, str]]) -> None:
    """paramiko runs ``Match exec`` commands during lookup, so refuse before looking up."""
    for text, origin in lines:
        match = _SETTING.match(text)
        if match and match.group(1).lower() == "match":
            words = match.group(2).replace("=", " ").split()
            if any(w.lstrip("!").lower() == "exec" for w in words):
                raise ConnectError(
                    "ssh config directive `Match exec` refused", origin,
                    "looking up any host in this file would run its local shell command",
                    "Remove the Match exec block, point --ssh-config at another file, or "
                    "pass --ssh-allow-config-exec if you trust this file")


def _load_config(opts: SSHOptions) -> tuple[paramiko.SSHConfig, list[tuple[str, str]]]:
    path = opts.config_file
    if path is None:
        default = Path.home() / ".ssh" / "config"
        if not default.is_file():
            return paramiko.SSHConfig(), []
        path = default
    lines = _config_lines(Path(path))
    if not opts.allow_config_exec:
        _refuse_match_exec(lines)
    try:
        return paramiko.SSHConfig.from_text("\n".join(t for t, _ in lines)), lines
    except paramiko.ssh_exception.ConfigParseError as exc:
        raise ConnectError("cannot parse ssh config", str(path), str(exc),
                           "Fix the line or pass another file with --ssh-config") from None


def _check_name(value: str, kind: str, where: str, pattern: re.Pattern[str]) -> None:
    """Names flow into %h expansions, MASTER_ADDR and logs: no options, no metacharacters."""
    if not value or value.startswith("-") or not pattern.fullmatch(value):
        raise ConnectError(f"{kind} {value!r} refused", where,
                           "it is empty, starts with '-' or contains whitespace, control or "
                           "shell characters", f"Use a plain {kind}")


def _known_hosts_files(found: paramiko.SSHConfigDict, opts: SSHOptions) -> tuple[Path, ...]:
    configured = [Path(os.path.expanduser(p)) for p in found.get("userknownhostsfile", "").split()]
    if opts.known_hosts is not None:
        configured = [Path(opts.known_hosts)]
    user_files = configured or [Path.home() / ".ssh" / "known_hosts"]
    return (*user_files, *hostkeys.GLOBAL_KNOWN_HOSTS)


def _number(found: paramiko.SSHConfigDict, key: str, where: str, kind: type = float):
    """A numeric ssh config value, None when absent; ConnectError naming the file when bad."""
    if key not in found:
        return None
    try:
        return kind(found[key])
    except ValueError:
        raise ConnectError(f"bad {key} in ssh config", where,
                           f"{found[key]!r} is not a{'n integer' if kind is int else ' number'}",
                           "Fix the value") from None


def _parse_jump(spec: str | None, opts: SSHOptions, depth: int) -> ResolvedHost | None:
    """``ProxyJump [user@]host[:port][,...]``: later hops go through earlier ones."""
    if not spec or spec.lower() == "none":
        return None
    if depth >= _MAX_JUMPS:
        raise ConnectError("ProxyJump chain refused", spec, f"more than {_MAX_JUMPS} hops "
                           "(a loop between Host blocks?)", "Fix ProxyJump in the ssh config")
    previous = None
    for hop in spec.split(","):
        hop = hop.strip().removeprefix("ssh://")
        user, _, hostport = hop.rpartition("@")
        host, port = hostport, None
        match = re.match(r"^\[(.+)\]:(\d+)$|^([^:]+):(\d+)$", hostport)
        if match:
            host, port = (match.group(1) or match.group(3)), int(match.group(2) or match.group(4))
        resolved = _resolve(host, user or None, port, opts, depth + 1)
        previous = dataclasses.replace(resolved, jump=previous) if previous else resolved
    return previous


def resolve_host(name: str, *, user: str | None, port: int | None,
                 opts: SSHOptions) -> ResolvedHost:
    """Apply the ssh config to ``name``; raises ConnectError, never executes anything."""
    return _resolve(name, user, port, opts, 0)


def _resolve(name: str, user: str | None, port: int | None, opts: SSHOptions,
             depth: int) -> ResolvedHost:
    _check_name(name, "host name", name, _HOST_OK)
    config, lines = _load_config(opts)
    found = config.lookup(name)
    origin = str(opts.config_file or Path.home() / ".ssh" / "config")
    proxy = found.get("proxycommand")
    if proxy and not opts.allow_config_exec:
        raise ConnectError(
            "ssh config directive `ProxyCommand` refused", _first_directive(lines, "proxycommand")
            or origin, f"host {name} would run the local shell command `{proxy}`",
            "Use ProxyJump instead, or pass --ssh-allow-config-exec if you trust the file")
    hostname = found["hostname"]
    _check_name(hostname, "host name", f"{name} (HostName)", _HOST_OK)
    user = user or found.get("user") or getpass.getuser()
    _check_name(user, "user name", name, _USER_OK)
    port = port or _number(found, "port", origin, int) or 22
    if not 0 < port < 65536:
        raise ConnectError("bad port", name, f"{port} is outside 1..65535", "Fix the port")
    files = tuple(os.path.expanduser(f) for f in found.get("identityfile", []) if f != "none")
    read_from = _known_hosts_files(found, opts)
    return ResolvedHost(
        alias=name, hostname=hostname, port=port, user=user,
        identity_files=files or tuple(os.path.expanduser(f) for f in _DEFAULT_KEYS),
        known_hosts=read_from[0], read_known_hosts=read_from,
        identities_only=found.get("identitiesonly", "no").lower() == "yes",
        connect_timeout=_number(found, "connecttimeout", origin) or opts.connect_timeout,
        proxy_command=proxy or None,
        jump=_parse_jump(found.get("proxyjump"), opts, depth),
    )


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


class _PublicKeyAuth(AuthStrategy):
    """publickey only, in OpenSSH's order: agent keys, then identity files (BatchMode-like)."""

    def __init__(self, host: ResolvedHost) -> None:
        super().__init__(ssh_config=None)
        self.host = host
        self.tried: list[str] = []
        self._agent: paramiko.Agent | None = None

    def get_sources(self):
        files = [(path, *_load_identity(path)) for path in self.host.identity_files]
        wanted = {_public_blob(path, key) for path, key, _ in files}
        offered = set()
        for key in self._agent.get_keys() if self._agent else ():
            if self.host.identities_only and key.get_base64() not in wanted:
                continue
            offered.add(key.get_base64())
            self.tried.append(f"agent key {hostkeys.fingerprint(key)} (rejected)")
            yield InMemoryPrivateKey(self.host.user, key)
        for path, key, note in files:
            if key is not None and key.get_base64() in offered:
                continue
            self.tried.append(f"{path} ({note})")
            if key is not None:
                yield OnDiskPrivateKey(self.host.user, "ssh-config", Path(path), key)

    def authenticate(self, transport: paramiko.Transport):
        # Last host-key check before we sign anything: paramiko ignores @revoked lines.
        hostkeys.check_not_revoked(self.host.key_name, transport.get_remote_server_key(),
                                   self.host.read_known_hosts, self.host.where)
        self._agent = _agent()
        try:
            return super().authenticate(transport)
        finally:
            if self._agent is not None:
                self._agent.close()  # agent keys sign only during authentication


# ---------------------------------------------------------------- connecting


def _resolve_addresses(host: ResolvedHost, deadline: float) -> list[tuple]:
    """getaddrinfo bounded by the connect timeout (a dead DNS server can stall it for long)."""
    result: dict[str, object] = {}

    def lookup() -> None:
        try:
            result["ok"] = socket.getaddrinfo(host.hostname, host.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            result["error"] = exc

    worker = threading.Thread(target=lookup, daemon=True, name=f"resolve-{host.hostname}")
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()))
    if "ok" in result:
        return result["ok"]  # type: ignore[return-value]
    why = str(result.get("error") or f"no answer within {host.connect_timeout:g} s")
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


def _tcp_connect(host: ResolvedHost, keepalive: float) -> socket.socket:
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


def _tunnel(host: ResolvedHost, jump: SSHConnection) -> paramiko.Channel:
    """A direct-tcpip channel from the jump host to ``host`` (ProxyJump, OpenSSH's -W)."""
    try:
        return jump.transport.open_channel("direct-tcpip", (host.hostname, host.port),
                                           ("127.0.0.1", 0), timeout=host.connect_timeout)
    except paramiko.ChannelException as exc:
        why = f"the jump host could not open a tunnel to {host.hostname}:{host.port} ({exc.text})"
    except (paramiko.SSHException, EOFError, OSError) as exc:
        why = f"the jump host connection failed while tunnelling: {exc or type(exc).__name__}"
    raise ConnectError(f"cannot connect to {host.alias} via {jump.host.alias}", host.where, why,
                       "Check that the jump host reaches the target and allows TCP forwarding")


def _handshake_error(host: ResolvedHost, exc: BaseException, opts: SSHOptions,
                     auth: _PublicKeyAuth) -> ConnectError:
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


def _handshake_slot(key_name: str) -> threading.BoundedSemaphore:
    """At most 8 concurrent handshakes per endpoint (Hydra's throttle): a jump host shared by
    many targets would otherwise see a burst beyond sshd's MaxStartups (10:30:100)."""
    with _slots_lock:
        return _handshake_slots.setdefault(key_name,
                                           threading.BoundedSemaphore(_HANDSHAKES_PER_HOST))


def _transient(exc: BaseException) -> bool:
    """A dropped connection before the banner: sshd's MaxStartups throttling, worth a retry."""
    cause = exc.__context__ or exc.__cause__
    return ("banner" in str(exc) and isinstance(cause, (EOFError, ConnectionResetError))) or \
        isinstance(exc, (EOFError, ConnectionResetError))


def _open_socket(host: ResolvedHost, opts: SSHOptions,
                 jump: SSHConnection | None) -> socket.socket | paramiko.Channel:
    if jump is not None:
        return _tunnel(host, jump)
    if host.proxy_command:
        return paramiko.ProxyCommand(host.proxy_command)
    return _tcp_connect(host, opts.keepalive)


def _handshake(client: paramiko.SSHClient, sock: object, host: ResolvedHost,
               opts: SSHOptions, auth: _PublicKeyAuth) -> None:
    """Verify the host key and authenticate over an open socket."""
    hostkeys.load_into(client.get_host_keys(), host.read_known_hosts)
    client.set_missing_host_key_policy(hostkeys.KnownHostsPolicy(
        known_hosts=host.known_hosts, read_from=host.read_known_hosts,
        accept_new=opts.accept_new, where=host.where, host=host.hostname, port=host.port))
    client.connect(host.hostname, port=host.port, username=host.user, sock=sock,
                   timeout=opts.handshake_timeout, banner_timeout=opts.banner_timeout,
                   auth_timeout=opts.auth_timeout, auth_strategy=auth)


def _shutdown(client: paramiko.SSHClient, sock: object) -> None:
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


def _close_socket(sock: object) -> None:
    """Close a socket, channel or ProxyCommand; a ProxyCommand's process is also reaped."""
    with contextlib.suppress(OSError):
        sock.close()  # type: ignore[attr-defined]
    if isinstance(sock, paramiko.ProxyCommand):
        try:
            sock.process.wait(5)
        except subprocess.TimeoutExpired:
            sock.process.kill()
            sock.process.wait()


class SSHConnection:
    """An authenticated connection to one host; channels are opened on it."""

    def __init__(self, host: ResolvedHost, client: paramiko.SSHClient, latency_ms: float,
                 opts: SSHOptions, jump: SSHConnection | None = None,
                 sock: object = None) -> None:
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
        client, auth, sock = paramiko.SSHClient(), _PublicKeyAuth(host), None
        try:
            with _handshake_slot(host.key_name):
                sock = _open_socket(host, opts, jump)
                _handshake(client, sock, host, opts, auth)
        except BaseException as exc:
            _shutdown(client, sock)
            if jump is not None:
                jump.close()
            if isinstance(exc, ConnectError):
                raise
            if isinstance(exc, paramiko.BadHostKeyException):
                raise hostkeys.changed_key_error(host.key_name, exc.key, exc.expected_key,
                                                 host.read_known_hosts, host.where) from None
            if not isinstance(exc, Exception):
                raise
            error = _handshake_error(host, exc, opts, auth)
            if _transient(exc):
                raise _Retry(error) from None
            raise error from None
        client.get_transport().set_keepalive(max(1, int(opts.keepalive)))
        return cls(host, client, (time.monotonic() - start) * 1000.0, opts, jump, sock)

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
        return SSHAgentStream(self.host.alias, channel)

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
        _shutdown(self._client, self._sock)
        self._sock = None
        if self._jump is not None:
            self._jump.close()


class _Retry(Exception):
    def __init__(self, error: ConnectError) -> None:
        super().__init__(str(error))
        self.error = error


class SSHAgentStream:
    """`launcher.transport.AgentStream` over a paramiko session channel.

    stderr is drained by a thread into a bounded buffer: paramiko shares one flow-control
    window between stdout and stderr, so an undrained stderr would stall stdout (and the
    agent prints its startup traceback there, which `stderr_text` exposes for error messages).
    """

    def __init__(self, host: str, channel: paramiko.Channel) -> None:
        self.host = host
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
