"""The agent over the system OpenSSH client: one `ssh` process per host, its pipes the stream.

    dtrain launch --ssh-client openssh --hostfile hosts -- python train.py

    ssh -T -e none -x -a -o BatchMode=yes -o StrictHostKeyChecking=yes [-F config]
        [-o UserKnownHostsFile=...] [-o ConnectTimeout=N] [-l user] [-p port]
        -- HOST '<python>' -E -P -u -m launcher.agent

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
import os
import shlex
import shutil
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from launcher.errors import ConnectError, HostKeyError, UsageError
from launcher.hosts.hostfile import HostEntry
from launcher.transport.local import LocalAgentStream, agent_command
from launcher.transport.openssh.config import ConfigReader, host_options, last_line
from launcher.transport.options import SSHOptions
from launcher.transport.table import Opened

#: ssh's exit code for its own errors (connect, host key, authentication).
SSH_FAILED = 255


class OpenSSHHost:
    """The `connection` of one `ssh` process: where it goes, and when the agent first spoke.

    Where it goes is what `ssh -G` says, asked only when needed: before the session when the
    config may be refused, else when rank 0's route or an error message needs it (each `ssh`
    process costs CPU that the agents and ranks starting beside it would use)."""

    def __init__(self, entry: HostEntry, reader: ConfigReader | None) -> None:
        """``reader``: None for a host whose config was resolved elsewhere (a relay's hop,
        `launcher.tree.hops`), `learn`ed before use."""
        self.entry, self.alias, self._reader = entry, entry.name, reader
        self._found: dict[str, str] | None = None
        self.latency_ms = 0.0
        self._started = time.monotonic()

    def learn(self, found: dict[str, str]) -> None:
        self._found = found

    @property
    def config(self) -> dict[str, str]:
        """`ssh -G` for this host ({} without a config file); ConnectError when it fails."""
        if self._found is None:
            self._found = self._reader.read([self.entry])[0] if self._reader is not None else {}
        return self._found

    @property
    def hostname(self) -> str:
        return self.config.get("hostname", self.entry.name)

    @property
    def user(self) -> str:
        return self.config.get("user") or self.entry.user or getpass.getuser()

    @property
    def port(self) -> int:
        return int(self.config.get("port") or self.entry.port or 22)

    @property
    def known_hosts(self) -> str:
        return self.config.get("userknownhostsfile", "~/.ssh/known_hosts").split()[0]

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

    def _arrived(self, data: bytes) -> None:
        if data:
            self.node.first_byte()

    def transport_error(self) -> ConnectError | None:
        """ssh's own failure, once the stream closed: None when ssh did not fail (the agent
        itself exited, whatever its code)."""
        if self.node.latency_ms or self.wait(5.0) != SSH_FAILED:
            return None  # the agent spoke (the connection worked), or ssh did not fail
        self._stderr_reader.join(1.0)  # ssh's last words, read to their end
        return ssh_failure(self.node, self.stderr_text())


def start_agents(entries: Sequence[HostEntry], *, python: str, opts: SSHOptions,
                 opened: Opened | None = None) -> list[OpenSSHAgentStream | ConnectError]:
    """One `ssh` per host, all started before any is waited on, each told to ``opened`` as
    it starts. A config that may be refused is read first (a refused directive raises,
    nothing connects); one that cannot be is read for a host only when its address is needed
    (`OpenSSHHost.config`)."""
    ssh = shutil.which("ssh")
    if ssh is None:
        raise UsageError("no ssh client", "--ssh-client openssh", "no `ssh` command on PATH",
                         "install the OpenSSH client, or use --ssh-client paramiko")
    reader = ConfigReader(ssh, opts)
    first = reader.needed_first or opts.accept_new  # accept-new: known_hosts made 0600 first
    hosts = [OpenSSHHost(e, reader) for e in entries]
    if first:
        for host, found in zip(hosts, reader.read(entries), strict=True):
            host.learn(found)
    if opts.accept_new:
        for path in {Path(os.path.expanduser(host.known_hosts)) for host in hosts}:
            _private_file(path)
    streams: list[OpenSSHAgentStream | ConnectError] = []
    for index, host in enumerate(hosts):
        try:
            # Without a first reading, the config sets no ConnectTimeout: {} is exact here.
            found = host.config if first else {}
            stream = OpenSSHAgentStream(host, session_argv(ssh, host.entry, opts, found, python))
            if opened is not None:
                opened(index, stream)
            streams.append(stream)
        except OSError as exc:
            streams.append(ConnectError(f"cannot start ssh for {host.alias}",
                                        f"host {host.alias}", str(exc),
                                        "check that the ssh client runs here"))
    return streams


def _private_file(path: Path) -> None:
    """known_hosts as paramiko's path makes it (folder 0700, file 0600): ssh appends new keys
    but creates neither outside ~/.ssh."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600))


def session_argv(ssh: str, entry: HostEntry, opts: SSHOptions, found: dict[str, str],
                 python: str) -> list[str]:
    """The `ssh` command for one host: options, `--`, the host, the quoted agent command."""
    return [ssh, *session_options(opts, found), *host_options(entry, opts), "--", entry.name,
            shlex.join(agent_command(python))]


def session_options(opts: SSHOptions, found: dict[str, str]) -> list[str]:
    """No tty, no escape character (binary frames), no forwarding, no prompt, keys checked."""
    policy = "accept-new" if opts.accept_new else "yes"
    argv = ["-T", "-e", "none", "-x", "-a", "-o", "BatchMode=yes",
            "-o", f"StrictHostKeyChecking={policy}", "-o", "ClearAllForwardings=yes",
            "-o", f"ServerAliveInterval={max(1, math.ceil(opts.keepalive))}",
            "-o", "ServerAliveCountMax=3"]
    if found.get("connecttimeout", "none") == "none":  # the config's value wins, as for paramiko
        argv += ["-o", f"ConnectTimeout={max(1, math.ceil(opts.connect_timeout))}"]
    return argv


def ssh_failure(host: OpenSSHHost, stderr: str) -> ConnectError:
    """The one error for an `ssh` that exited 255: what ssh said, read for its cause."""
    what, where = f"cannot connect to {host.alias}", host.where
    said = last_line(stderr) or "ssh exited with code 255 and said nothing"
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
