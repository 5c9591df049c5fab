"""ssh_config resolution: a host name becomes a `ResolvedHost`, with nothing executed.

``~/.ssh/config`` is read with paramiko's parser (`resolve_host`): Host aliases, HostName,
User, Port, IdentityFile, IdentitiesOnly, UserKnownHostsFile, ConnectTimeout, ProxyJump and
Include (spliced in place, an approximation of OpenSSH's rule). Directives that run a local
command (``Match exec``, ``ProxyCommand``, ``KnownHostsCommand``, ``LocalCommand``) are
refused unless ``SSHOptions.allow_config_exec`` (`ssh_config_refusal`). Explicit
``user``/``port`` arguments win over the config (as ``ssh -l/-p`` do); a config
``ConnectTimeout`` wins over ``SSHOptions.connect_timeout``.

Every failure is a `ConnectError` (exit code 255).
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import paramiko

from launcher.errors import ConnectError
from launcher.transport import host_keys
from launcher.transport.options import SSHOptions
from launcher.transport.ssh_config_refusal import (
    ConfigLine,
    command_value,
    read_config,
    refuse_host_commands,
    refuse_match_exec,
)

_HOST_OK = re.compile(r"^[A-Za-z0-9._:\[\]-]+$")
_USER_OK = re.compile(r"^[A-Za-z0-9._@\\$-]+$")
_DEFAULT_KEYS = ("~/.ssh/id_rsa", "~/.ssh/id_ecdsa", "~/.ssh/id_ed25519")
_MAX_JUMPS = 8
_Number = TypeVar("_Number", int, float)
#: An ssh config read and parsed (`_load_config`): its paramiko form and its lines.
_Loaded = tuple[paramiko.SSHConfig, list[ConfigLine]]


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
        return host_keys.key_name(self.hostname, self.port)

    @property
    def where(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


def _load_config(opts: SSHOptions) -> _Loaded:
    """The parsed config and its lines; the Match exec refusal comes before paramiko parses."""
    path = opts.config_file
    if path is None:
        default = Path.home() / ".ssh" / "config"
        if not default.is_file():
            return paramiko.SSHConfig(), []
        path = default
    lines = read_config(Path(path))
    if not opts.allow_config_exec:
        refuse_match_exec(lines)
    return _parse(lines, str(path)), lines


def _parse(lines: list[ConfigLine], where: str) -> paramiko.SSHConfig:
    try:
        return paramiko.SSHConfig.from_text("\n".join(line.text for line in lines))
    except paramiko.ssh_exception.ConfigParseError as exc:
        raise ConnectError("cannot parse ssh config", where, str(exc),
                           "Fix the line or pass another file with --ssh-config") from None


def directive_origin(lines: list[ConfigLine], key: str, name: str, default: str) -> str:
    """Which line gave ``name`` its ``key``: the first one that still applies when it is the
    only line setting ``key`` (paramiko's first-value-wins rule, without copying its matching).
    Only called on the refusal path, where no Match exec is left to run."""
    for line in lines:
        if line.keyword == key:
            alone = [x for x in lines if x.keyword != key or x is line]
            if command_value(_parse(alone, default).lookup(name), key) is not None:
                return line.origin
    return default


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
    return (*user_files, *host_keys.GLOBAL_KNOWN_HOSTS)


def _number(found: paramiko.SSHConfigDict, key: str, where: str,
            kind: Callable[[str], _Number]) -> _Number | None:
    """A numeric ssh config value, None when absent; ConnectError naming the file when bad."""
    if key not in found:
        return None
    try:
        return kind(found[key])
    except ValueError:
        raise ConnectError(f"bad {key} in ssh config", where,
                           f"{found[key]!r} is not a{'n integer' if kind is int else ' number'}",
                           "Fix the value") from None


def _parse_jump(spec: str | None, opts: SSHOptions, depth: int,
                loaded: _Loaded) -> ResolvedHost | None:
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
        resolved = _resolve(host, user or None, port, opts, depth + 1, loaded)
        previous = dataclasses.replace(resolved, jump=previous) if previous else resolved
    return previous


def resolve_host(name: str, *, user: str | None, port: int | None,
                 opts: SSHOptions) -> ResolvedHost:
    """Apply the ssh config to ``name``; raises ConnectError, never executes anything."""
    return _resolve(name, user, port, opts, 0, _load_config(opts))


def resolve_hosts(hosts: Sequence[tuple[str, str | None, int | None]],
                  opts: SSHOptions) -> list[ResolvedHost]:
    """`resolve_host` of each (name, user, port), the config read and parsed once: once per
    host, a config naming 64 namespace hosts was 0.3 s of the head's CPU before its first
    connection (before a fan-out's first relay started), growing with the square of the
    hosts."""
    loaded = _load_config(opts)
    return [_resolve(name, user, port, opts, 0, loaded) for name, user, port in hosts]


def _resolve(name: str, user: str | None, port: int | None, opts: SSHOptions,
             depth: int, loaded: _Loaded) -> ResolvedHost:
    _check_name(name, "host name", name, _HOST_OK)
    config, lines = loaded
    found = config.lookup(name)
    origin = str(opts.config_file or Path.home() / ".ssh" / "config")
    if not opts.allow_config_exec:
        refuse_host_commands(name, found, lambda key: directive_origin(lines, key, name, origin))
    proxy = command_value(found, "proxycommand")
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
        connect_timeout=_number(found, "connecttimeout", origin, float) or opts.connect_timeout,
        proxy_command=proxy,
        jump=_parse_jump(found.get("proxyjump"), opts, depth, loaded),
    )

