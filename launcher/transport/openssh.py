"""The agent over the system OpenSSH client: one `ssh` process per host, its pipes the stream.

    dtrain launch --ssh-client openssh --hostfile hosts -- python train.py

    ssh -T -e none -x -a -o BatchMode=yes -o StrictHostKeyChecking=yes [-F config]
        [-o UserKnownHostsFile=...] [-o ConnectTimeout=N] [-l user] [-p port]
        -- HOST '<python>' -u -m launcher.agent

The stream is the local transport's (`LocalAgentStream`): the same pipes, EOF and kill rules,
with `ssh` in between. The head imports no paramiko and starts every `ssh` at once, so the
handshakes overlap each other and the head's own imports.

Security: the argv is a list (no local shell); the destination follows `--`; host and user
names were validated by the hostfile parser; the remote command is the constant agent command
with every word `shlex.quote`d. Host keys are verified (`StrictHostKeyChecking=yes`,
`accept-new` only with --ssh-accept-new) and `BatchMode=yes` means no prompt can hang a launch.
The ssh config is read by ssh itself (`ssh -G`, OpenSSH's own resolution) and refused as for
paramiko (`ssh_config_refusal`) before anything connects: ``Match exec``, ``ProxyCommand``,
``KnownHostsCommand``, ``LocalCommand`` need --ssh-allow-config-exec. A ProxyJump hop is a
second `ssh` that OpenSSH starts with the same ``-F`` file, so it follows that file's settings.

ssh's own failures (exit code 255 before the agent spoke) become one `ConnectError` naming the
host and the fix (`ssh_failure`).
"""

from __future__ import annotations

import getpass
import math
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from launcher.errors import ConnectError, HostKeyError, UsageError
from launcher.hosts.hostfile import HostEntry
from launcher.transport.local import LocalAgentStream, agent_command
from launcher.transport.options import SSHOptions
from launcher.transport.ssh_config_refusal import (
    ConfigLine,
    read_config,
    refuse_host_commands,
    refuse_match_exec,
)

#: ssh's exit code for its own errors (connect, host key, authentication).
SSH_FAILED = 255


class OpenSSHHost:
    """The `connection` of one `ssh` process: where it goes, and when the agent first spoke."""

    def __init__(self, entry: HostEntry, found: dict[str, str]) -> None:
        self.alias = entry.name
        self.hostname = found.get("hostname", entry.name)
        self.user = found.get("user") or entry.user or getpass.getuser()
        self.port = int(found.get("port") or entry.port or 22)
        self.known_hosts = found.get("userknownhostsfile", "~/.ssh/known_hosts").split()[0]
        self.config = found                # `ssh -G` output; {} without a config file
        self.latency_ms = 0.0
        self._started = time.monotonic()

    @property
    def where(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"

    def peer_address(self) -> str:
        """The HostName ssh connects to, resolved here (as behind a paramiko ProxyJump)."""
        try:
            return str(socket.getaddrinfo(self.hostname, None, type=socket.SOCK_STREAM)[0][4][0])
        except OSError:
            return self.hostname

    def first_byte(self) -> None:
        if not self.latency_ms:
            self.latency_ms = (time.monotonic() - self._started) * 1000

    def close(self) -> None:
        """Nothing to close: the connection ends with its `ssh` process (the stream's)."""


class OpenSSHAgentStream(LocalAgentStream):
    """AgentStream over the pipes of one `ssh` process running the agent on its host."""

    is_local = False

    def __init__(self, host: OpenSSHHost, argv: Sequence[str]) -> None:
        self.node = host
        self.connection = host
        super().__init__(host.alias, command=argv)

    def read(self, max_bytes: int = 65536) -> bytes:
        data = super().read(max_bytes)
        if data:
            self.node.first_byte()
        return data

    def transport_error(self) -> ConnectError | None:
        """ssh's own failure, once the stream closed: None when ssh did not fail (the agent
        itself exited, whatever its code)."""
        if self.node.latency_ms or self.wait(5.0) != SSH_FAILED:
            return None  # the agent spoke (the connection worked), or ssh did not fail
        self._stderr_reader.join(1.0)  # ssh's last words, read to their end
        return ssh_failure(self.node, self.stderr_text())


def start_agents(entries: Sequence[HostEntry], *, python: str,
                 opts: SSHOptions) -> list[OpenSSHAgentStream | ConnectError]:
    """One `ssh` per host, all started before any is waited on; the config is checked first
    (a refused directive raises, nothing connects)."""
    ssh = shutil.which("ssh")
    if ssh is None:
        raise UsageError("no ssh client", "--ssh-client openssh", "no `ssh` command on PATH",
                         "install the OpenSSH client, or use --ssh-client paramiko")
    resolved = resolve_hosts(ssh, entries, opts)
    if opts.accept_new and opts.known_hosts is not None:
        # ssh records a new key but does not create the file's folder (paramiko's path does).
        opts.known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    command = shlex.join(agent_command(python))
    streams: list[OpenSSHAgentStream | ConnectError] = []
    for entry, host in zip(entries, resolved, strict=True):
        argv = [ssh, *_session_options(opts, host.config), *_host_options(entry, opts), "--",
                entry.name, command]
        try:
            streams.append(OpenSSHAgentStream(host, argv))
        except OSError as exc:
            streams.append(ConnectError(f"cannot start ssh for {entry.name}", host.where,
                                        str(exc), "check that the ssh client runs here"))
    return streams


def resolve_hosts(ssh: str, entries: Sequence[HostEntry],
                  opts: SSHOptions) -> list[OpenSSHHost]:
    """Every host's config as ssh will use it (`ssh -G`, in parallel), each refused as the
    paramiko path refuses it; no config file: the names as they are, no process started."""
    config = _config_file(opts)
    if config is None:
        return [OpenSSHHost(e, {}) for e in entries]
    lines = read_config(config)
    if not opts.allow_config_exec:
        refuse_match_exec(lines)  # before `ssh -G`, which runs Match exec
    probes = [subprocess.Popen([ssh, "-G", *_host_options(e, opts), "--", e.name],
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for e in entries]
    resolved = []
    for entry, probe in zip(entries, probes, strict=True):
        out, err = probe.communicate()
        if probe.returncode != 0:
            raise ConnectError("cannot read the ssh config", f"{config} (host {entry.name})",
                               _last_line(err) or f"`ssh -G` exited {probe.returncode}",
                               "Fix the config or pass another file with --ssh-config")
        found = _parse_g(out)
        if not opts.allow_config_exec:
            refuse_host_commands(entry.name, found,
                                 lambda key: _origin(lines, key, str(config)))
        resolved.append(OpenSSHHost(entry, found))
    return resolved


def _config_file(opts: SSHOptions) -> Path | None:
    if opts.config_file is not None:
        return Path(opts.config_file)
    default = Path.home() / ".ssh" / "config"
    return default if default.is_file() else None


def _host_options(entry: HostEntry, opts: SSHOptions) -> list[str]:
    """What `ssh -G` and the session share: the config file, known_hosts, user and port."""
    argv = ["-F", str(opts.config_file)] if opts.config_file is not None else []
    if opts.known_hosts is not None:
        argv += ["-o", f"UserKnownHostsFile={_ssh_path(opts.known_hosts)}"]
    if entry.user:
        argv += ["-l", entry.user]
    if entry.port:
        argv += ["-p", str(entry.port)]
    return argv


def _session_options(opts: SSHOptions, found: dict[str, str]) -> list[str]:
    """No tty, no escape character (binary frames), no forwarding, no prompt, keys checked."""
    policy = "accept-new" if opts.accept_new else "yes"
    argv = ["-T", "-e", "none", "-x", "-a", "-o", "BatchMode=yes",
            "-o", f"StrictHostKeyChecking={policy}", "-o", "ClearAllForwardings=yes",
            "-o", f"ServerAliveInterval={max(1, math.ceil(opts.keepalive))}",
            "-o", "ServerAliveCountMax=3"]
    if found.get("connecttimeout", "none") == "none":  # the config's value wins, as for paramiko
        argv += ["-o", f"ConnectTimeout={max(1, math.ceil(opts.connect_timeout))}"]
    return argv


def _ssh_path(path: Path) -> str:
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


def _origin(lines: Sequence[ConfigLine], key: str, default: str) -> str:
    """The first line setting ``key`` (ssh's first-value-wins rule)."""
    return next((line.origin for line in lines if line.keyword == key), default)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def ssh_failure(host: OpenSSHHost, stderr: str) -> ConnectError:
    """The one error for an `ssh` that exited 255: what ssh said, read for its cause."""
    what, where = f"cannot connect to {host.alias}", host.where
    said = _last_line(stderr) or "ssh exited with code 255 and said nothing"
    key_name = host.hostname if host.port == 22 else f"[{host.hostname}]:{host.port}"
    port_opt = "" if host.port == 22 else f"-p {host.port} "
    named = key_name if host.alias == host.hostname else f"{host.alias} ({key_name})"
    if "IDENTIFICATION HAS CHANGED" in stderr or "Offending" in stderr:
        return HostKeyError(f"host key of {named} has CHANGED", where,
                            "the server presented another key than known_hosts records (a "
                            "reinstalled host, or someone intercepting the connection)",
                            f"Verify the new key out of band, then run `ssh-keygen -R "
                            f"{key_name}`; dtrain never replaces a changed key")
    if "host key is known" in stderr or "Host key verification failed" in stderr:
        return HostKeyError(f"host key of {named} is not known", where,
                            f"no entry for {key_name} in {host.known_hosts} or the global "
                            "known_hosts files, and unknown keys are refused",
                            f"Verify the fingerprint out of band (`ssh-keyscan {port_opt}"
                            f"{host.hostname} | ssh-keygen -lf -`), then append that "
                            f"`ssh-keyscan` output to {host.known_hosts}, or pass "
                            "--ssh-accept-new to record new host keys on first contact")
    if "Permission denied" in stderr:
        return ConnectError(what, where, f"authentication failed as {host.user} ({said})",
                            "Add your public key to the host's authorized_keys, load a "
                            "passphrase-protected key into ssh-agent, or set IdentityFile in "
                            "the ssh config; dtrain never prompts for passwords")
    for cause in ("Connection refused", "Connection timed out", "No route to host",
                  "Could not resolve hostname", "Network is unreachable"):
        if cause in stderr:
            return ConnectError(what, where, f"{cause.lower()} ({said})",
                                "Check the host name, the port and that sshd runs there")
    return ConnectError(what, where, f"ssh exited 255: {said}",
                        f"Run `ssh -v {shlex.quote(host.alias)} true` to see why")
