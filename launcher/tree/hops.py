"""What a relay needs to start its subtree's agents as the head would, and nothing more.

The head resolves every host's ssh config itself (refusing what runs code, as for a flat
launch) and hands each relay, per host below it: where to connect (address, port, user), which
key files to offer (paths on the relay's host: a relay authenticates with its own host's
keys, as Open MPI's tree spawn does; nothing secret travels), the connect timeout, and the
known_hosts lines the head holds for that host. The relay verifies every hop strictly
against those lines (no trust on first use below the head: the head never saw those keys), in
a private file of its own, and does not read its host's ssh config: the head's reading is the
one that was checked. A host the head has no key for is refused before anything connects.

A relay connects with the head's --ssh-client: dtrain's own (paramiko), or the system's `ssh`
run as ``ssh -F /dev/null`` with every resolved value on its command line (a list, no shell),
the private known_hosts file, ``StrictHostKeyChecking=yes`` and ``BatchMode=yes``: the same
checks as the head's, from the head's reading of the config.

Hosts reached through ProxyJump or ProxyCommand are not relayed (the hop would run through a
third host the relay knows nothing about): the launch says so and asks for --fanout 0.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from launcher.errors import ConnectError, HostKeyError, UsageError
from launcher.hosts.hostfile import HostEntry
from launcher.transport.options import SSHOptions

#: The SSHOptions fields a relay uses as the head does (timeouts, parallel handshakes).
FORWARDED_OPTIONS = ("connect_timeout", "banner_timeout", "auth_timeout", "keepalive",
                     "max_parallel", "handshake_timeout", "channel_timeout")


def describe(entries: Sequence[HostEntry], opts: SSHOptions) -> list[dict[str, Any]]:
    """Each host's hop, as the head resolved and verified it; raises before anything
    connects when a host cannot be relayed. Each hop names the client the relay connects
    with (the head's --ssh-client)."""
    from launcher.transport import host_keys
    from launcher.transport.ssh import resolve_hosts

    for entry in entries:
        if entry.is_local:
            raise UsageError("a local host cannot be relayed", f"host {entry.name}",
                             "it is the head's own host", "use --fanout 0 (flat)")
    hops = []
    for entry, host in zip(entries, resolve_hosts([(e.name, e.user, e.port) for e in entries],
                                                  opts), strict=True):
        if host.jump is not None or host.proxy_command:
            raise UsageError("a host behind ProxyJump/ProxyCommand cannot be relayed",
                             f"host {entry.name}", "its hop runs through a third host",
                             "use --fanout 0 (flat)")
        lines = [f"{host.key_name} {kind} {b64}" for _path, _line, kind, b64
                 in host_keys.find_entries(host.key_name, host.read_known_hosts)
                 if not _revoked(host.key_name, kind, b64, host.read_known_hosts)]
        if not lines:
            raise HostKeyError(
                f"host key of {host.key_name} is not known", host.where,
                f"a relay starts this host and checks its key against the head's known_hosts "
                f"({host.known_hosts}), which has no entry for it",
                f"Verify the key, then run `ssh-keyscan -p {host.port} {host.hostname} >> "
                f"{host.known_hosts}`, or launch once with --fanout 0 --ssh-accept-new")
        hops.append({"client": opts.client, "hostname": host.hostname, "port": host.port,
                     "user": host.user,
                     "identity_files": list(host.identity_files),
                     "identities_only": host.identities_only,
                     "connect_timeout": host.connect_timeout, "known_hosts": lines})
    return hops


def client_of(children: Mapping[int, Mapping[str, Any]]) -> str:
    """The --ssh-client the head chose, which every hop it describes carries."""
    first: Mapping[str, Any] = next(iter(children.values()), {})
    return str((first.get("hop") or {}).get("client", "paramiko"))


def _revoked(name: str, kind: str, b64: str, paths: Sequence[Path]) -> bool:
    from launcher.transport import host_keys

    return any(fields[0] == "@revoked" and len(fields) >= 4
               and host_keys._names_match(fields[1], name) and fields[2:4] == [kind, b64]
               for _p, _n, fields in host_keys._known_lines(paths))


def forwarded_options(opts: SSHOptions) -> dict[str, Any]:
    return {name: getattr(opts, name) for name in FORWARDED_OPTIONS}


class RelayKeys:
    """The relay's side: a private folder with one known_hosts file for its hops: ``folder``
    (new, 0700: the agent's, named so that the next agent on the host removes it if this one
    is SIGKILLed, `launcher.agent.leftovers`)."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self.file = self.folder / "known_hosts"
        os.close(os.open(self.file, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600))

    def _record(self, hop: Mapping[str, Any]) -> None:
        with open(self.file, "a") as out:
            out.writelines(f"{line}\n" for line in hop["known_hosts"] if "\n" not in line)

    def resolved(self, name: str, hop: Mapping[str, Any]) -> Any:
        """The ResolvedHost to connect to ``name`` (its known_hosts lines recorded)."""
        from launcher.transport.ssh_config import ResolvedHost

        self._record(hop)
        return ResolvedHost(alias=name, hostname=str(hop["hostname"]), port=int(hop["port"]),
                            user=str(hop["user"]),
                            identity_files=tuple(str(f) for f in hop["identity_files"]),
                            known_hosts=self.file, read_known_hosts=(self.file,),
                            identities_only=bool(hop["identities_only"]),
                            connect_timeout=float(hop["connect_timeout"]))

    def openssh_stream(self, ssh: str, name: str, hop: Mapping[str, Any], opts: SSHOptions,
                       command: str) -> Any:
        """The system `ssh` running the agent on ``name`` as ``hop`` says (its known_hosts lines
        recorded): an `OpenSSHAgentStream`, whose process is the relay's child."""
        from launcher.transport.openssh.config import ssh_value
        from launcher.transport.openssh.session import (
            OpenSSHAgentStream,
            OpenSSHHost,
            session_options,
        )

        self._record(hop)
        user, port, timeout = str(hop["user"]), int(hop["port"]), float(hop["connect_timeout"])
        host = OpenSSHHost(HostEntry(name, 1, user=user, port=port), None)
        host.learn({"hostname": str(hop["hostname"]), "port": str(port), "user": user,
                    "userknownhostsfile": str(self.file)})
        identities = [word for path in hop["identity_files"] for word in ("-i", str(path))]
        argv = [ssh, "-F", os.devnull, *session_options(opts, {"connecttimeout": "set"}),
                "-o", f"ConnectTimeout={max(1, math.ceil(timeout))}",
                "-o", f"UserKnownHostsFile={ssh_value(self.file)}",
                "-o", f"GlobalKnownHostsFile={os.devnull}",
                "-o", f"IdentitiesOnly={'yes' if hop['identities_only'] else 'no'}",
                *identities, "-l", user, "-p", str(port), "--", str(hop["hostname"]), command]
        return OpenSSHAgentStream(host, argv)

    def connector(self, children: Mapping[int, Mapping[str, Any]], python: str,
                  forwarded: Mapping[str, Any]) -> Callable[[Mapping[str, Any]], Any]:
        """How the relay starts each child's agent (its SUBTREE node: index, name, hop): over
        the head's --ssh-client, with the head's resolved values and timeouts; the stream."""
        from launcher.transport.local import agent_command

        opts = self.options(forwarded)
        command = shlex.join(agent_command(python))
        if client_of(children) == "openssh":
            ssh = shutil.which("ssh")

            def over_openssh(node: Mapping[str, Any]) -> Any:
                name = str(node["name"])
                if ssh is None:
                    raise ConnectError(f"cannot start ssh for {name}", f"host {name}",
                                       "the relay above it has no `ssh` command on its PATH",
                                       "install the OpenSSH client there, or use --ssh-client "
                                       "paramiko")
                return self.openssh_stream(ssh, name, node["hop"], opts, command)

            return over_openssh
        hosts = {int(i): self.resolved(str(c["name"]), c["hop"]) for i, c in children.items()}

        def over_paramiko(node: Mapping[str, Any]) -> Any:
            from launcher.transport.ssh import SSHConnection

            conn = SSHConnection.open(hosts[int(node["index"])], opts)
            try:
                return conn.exec_stream(command)
            except BaseException:
                conn.close()
                raise

        return over_paramiko

    def options(self, forwarded: Mapping[str, Any]) -> SSHOptions:
        """The head's timeouts; never trust on first use, never the relay's ssh config."""
        known = {k: forwarded[k] for k in FORWARDED_OPTIONS if k in forwarded}
        return replace(SSHOptions(), known_hosts=self.file, accept_new=False,
                       config_file=Path(os.devnull), **known)

    def remove(self) -> None:
        for path in (self.file, self.folder):
            try:
                path.unlink() if path.is_file() else path.rmdir()
            except OSError:
                pass
