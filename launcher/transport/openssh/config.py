"""ssh's own view of the ssh config for `transport.openssh.session`: `ssh -G` per host, refused as
`transport.ssh_config` refuses it for paramiko, before anything connects.

The files are those `ssh` reads (`files_ssh_reads`): the --ssh-config file alone (given to ssh
as -F), else ``~/.ssh/config`` (ssh's ``~``: the passwd entry's home, not $HOME) when it exists
and ``/etc/ssh/ssh_config`` with what it includes, even when there is no user file. ``Match
exec`` lines are refused on the raw lines of all of them (`ssh -G` would run them); then, for
every host and every ProxyJump hop (OpenSSH starts each hop as another `ssh` with the same
files), the values ssh will use: the `REFUSED` directives (commands and provider libraries)
unless --ssh-allow-config-exec, and HostName and hop names must be plain names. Only on the
way to a refusal is paramiko's parser asked which line set the directive.
"""

from __future__ import annotations

import os
import pwd
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

from launcher.errors import ConnectError, HostfileError
from launcher.hosts.hostfile import HostEntry
from launcher.hosts.names import validate_host_name, validate_user_name
from launcher.transport.options import SSHOptions
from launcher.transport.ssh_config_refusal import (
    REFUSED,
    SYSTEM_CONFIG,
    ConfigLine,
    IncludeRule,
    read_config,
    refuse_host_commands,
    refuse_match_exec,
)

#: Directives whose values must be known before `ssh` starts: those that run code (refused),
#: ProxyJump (starts `ssh` for another host, checked), and ConnectTimeout (it decides whether
#: dtrain passes its own).
NEEDED_FIRST = frozenset({*REFUSED, "proxyjump", "connecttimeout"})


def read_hosts(ssh: str, entries: Sequence[HostEntry], opts: SSHOptions) -> list[dict[str, str]]:
    """Every host's config as ssh will use it, refused as the paramiko path refuses it."""
    return ConfigReader(ssh, opts).read(entries)


class ConfigReader:
    """`ssh -G` for a host, and the refusals applied to what it prints, jump hops included
    (OpenSSH starts each hop as another `ssh` with the same ``-F`` file)."""

    def __init__(self, ssh: str, opts: SSHOptions) -> None:
        self.ssh, self.opts = ssh, opts
        self.files = files_ssh_reads(opts)
        self.lines = [line for path, rule in self.files for line in read_config(path, rule)]
        if not opts.allow_config_exec:
            refuse_match_exec(self.lines)  # before `ssh -G`, which runs Match exec

    @property
    def needed_first(self) -> bool:
        """True unless no line of the file (Includes spliced in) sets a `NEEDED_FIRST`
        directive: then nothing `ssh -G` could report is refused or changes ssh's command
        line, and it may run beside the sessions (off the launch's critical path)."""
        return any(line.keyword in NEEDED_FIRST for line in self.lines)

    def read(self, entries: Sequence[HostEntry]) -> list[dict[str, str]]:
        """`ssh -G` of every host, in parallel; no config file: {} each, no process."""
        if not self.files:
            return [{} for _ in entries]
        probes = [self.probe(e.name, e.user, e.port) for e in entries]
        return [self.checked(e.name, probe, 0) for e, probe in zip(entries, probes, strict=True)]

    def probe(self, name: str, user: str | None, port: int | None) -> subprocess.Popen[str]:
        entry_options = host_options(HostEntry(name, 1, user=user, port=port), self.opts)
        return subprocess.Popen([self.ssh, "-G", *entry_options, "--", name],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def checked(self, name: str, probe: subprocess.Popen[str], depth: int) -> dict[str, str]:
        out, err = probe.communicate()
        where = f"{' + '.join(str(path) for path, _ in self.files)} (host {name})"
        if probe.returncode != 0:
            raise ConnectError("cannot read the ssh config", where,
                               last_line(err) or f"`ssh -G` exited {probe.returncode}",
                               "Fix the config or pass another file with --ssh-config")
        found = _parse_g(out)
        if self.opts.allow_config_exec:
            return found  # trusted: ssh runs what the file says
        refuse_host_commands(name, found, lambda key: _origin(self.lines, key, name, where))
        _check_names(found.get("hostname", name), None, f"{where} HostName")
        for user, host, port in _jump_hops(found.get("proxyjump", "none"), where):
            if depth >= _MAX_JUMPS:
                raise ConnectError("ProxyJump chain refused", where, f"more than {_MAX_JUMPS} "
                                   "hops (a loop between Host blocks?)", "Fix ProxyJump")
            self.checked(host, self.probe(host, user, port), depth + 1)
        return found


_MAX_JUMPS = 8
_HOP = re.compile(r"^(?:ssh://)?(?:(?P<user>[^@]*)@)?(?:\[(?P<v6>[^]]+)\]|(?P<host>[^:]*))"
                  r"(?::(?P<port>\d+))?$")


def _jump_hops(spec: str, where: str) -> list[tuple[str | None, str, int | None]]:
    """``ProxyJump [user@]host[:port][,...]`` as (user, host, port) hops, names checked."""
    if spec.lower() == "none":
        return []
    hops = []
    for text in spec.split(","):
        match = _HOP.match(text.strip())
        host = (match.group("v6") or match.group("host")) if match else ""
        if match is None or not host:
            raise ConnectError("ProxyJump refused", where, f"cannot read the hop {text!r}",
                               "Write it as [user@]host[:port]")
        _check_names(host, match.group("user"), f"{where} ProxyJump")
        port = match.group("port")
        hops.append((match.group("user"), host, int(port) if port else None))
    return hops


def _check_names(host: str, user: str | None, where: str) -> None:
    """Names from the config reach ssh's own command lines: only plain names pass."""
    try:
        validate_host_name(host, where)
        if user is not None:
            validate_user_name(user, where)
    except HostfileError as exc:
        raise ConnectError("ssh config value refused", where, exc.why,
                           "Use a plain host or user name in the ssh config") from None


def files_ssh_reads(opts: SSHOptions) -> list[tuple[Path, IncludeRule]]:
    """The config files `ssh` reads, in its order, each with its Include rule: with -F that
    file only, else the user's file (if any) and the system file (if any)."""
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)  # ssh's `~`, whatever $HOME says
    if opts.config_file is not None:
        return [(Path(opts.config_file), IncludeRule.user(home))]
    found = [(home / ".ssh" / "config", IncludeRule.user(home)),
             (SYSTEM_CONFIG, IncludeRule.system(home))]
    return [(path, rule) for path, rule in found if path.is_file()]


def host_options(entry: HostEntry, opts: SSHOptions) -> list[str]:
    """What `ssh -G` and the session share: the config file, known_hosts, user and port."""
    argv = ["-F", str(opts.config_file)] if opts.config_file is not None else []
    if opts.known_hosts is not None:
        argv += ["-o", f"UserKnownHostsFile={ssh_value(opts.known_hosts)}"]
    if entry.user:
        argv += ["-l", entry.user]
    if entry.port:
        argv += ["-p", str(entry.port)]
    return argv


def ssh_value(path: Path) -> str:
    """A path as one ssh_config value: double-quoted, `%` tokens escaped."""
    text = str(path).replace("%", "%%").replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def _parse_g(out: str) -> dict[str, str]:
    """`ssh -G` output as {keyword: first value}."""
    found: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        found.setdefault(key.lower(), value.strip())
    return found


def _origin(lines: list[ConfigLine], key: str, name: str, default: str) -> str:
    """The line that gave ``name`` its ``key``, read by paramiko's parser: only on the way to
    a refusal, so a launch that connects never imports paramiko."""
    from launcher.transport.ssh_config import directive_origin

    return directive_origin(lines, key, name, default)


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""
