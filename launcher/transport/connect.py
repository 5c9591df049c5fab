"""One agent per host over the right transport: a local subprocess or one SSH session.

Each remote host is connected and its agent started in one worker, so a host's agent boots
while other hosts are still shaking hands. Agents start no rank until told to, so when any
host fails, closing the others' streams leaves nothing anywhere.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from launcher.errors import ConnectError, UsageError
from launcher.hosts.selection import HostSlots
from launcher.transport.local import LocalAgentStream, agent_command
from launcher.transport.options import SSHOptions
from launcher.transport.stream import AgentStream

# Starts the agents of all hosts another way than SSH: (selected, python=...) -> results.
AgentStarter = Callable[..., "list[AgentStream | ConnectError]"]

_SHELL_CHARS = "'\"`$;&|<>\\()*?[]{}!#~"


def validate_remote_python(path: str) -> str:
    """The interpreter path goes into the (constant) remote command: allow only plain paths."""
    if not os.path.isabs(path) or any(c.isspace() or c in _SHELL_CHARS for c in path):
        raise UsageError("unusable interpreter path", "--remote-python", f"{path!r}",
                         "give an absolute path without spaces or shell characters")
    return path


def open_streams(selected: Sequence[HostSlots], *, python: str, ssh: SSHOptions,
                 starter: AgentStarter | None = None) -> list[AgentStream]:
    """Agent streams in host order; ConnectError (nothing left running) if any host fails."""
    results = start_agents(selected, python=python, ssh=ssh, starter=starter)
    streams = [r for r in results if not isinstance(r, ConnectError)]
    errors = [r for r in results if isinstance(r, ConnectError)]
    if errors:
        close_streams(streams)
        raise errors[0] if len(errors) == 1 else ConnectError(
            f"{len(errors)} hosts could not be reached", "",
            "; ".join(str(e) for e in errors), "nothing was started anywhere")
    return streams


def start_agents(selected: Sequence[HostSlots], *, python: str, ssh: SSHOptions,
                 starter: AgentStarter | None = None) -> list[AgentStream | ConnectError]:
    """An agent stream, or why there is none, for every host, in host order; an ssh config
    that cannot be used (a refused directive, a bad name) raises before anything connects.
    A ``starter`` starts every host's agent its own way (`launcher.slurm.srun`: srun steps)."""
    python = validate_remote_python(python)
    if starter is not None:
        return starter(selected, python=python)
    results: dict[int, AgentStream | ConnectError] = {
        i: LocalAgentStream(h.entry.name, python=python)
        for i, h in enumerate(selected) if h.entry.is_local}
    remote = [(i, h) for i, h in enumerate(selected) if not h.entry.is_local]
    if remote:
        if not ssh.allow_config_exec and "invoke" not in sys.modules:
            # paramiko imports invoke only to run `Match exec` lines, which are refused unless
            # --ssh-allow-config-exec; blocking that import saves ~0.1 s of every launch.
            sys.modules["invoke"] = None  # type: ignore[assignment]  # `import` then fails
        # paramiko is imported only when a remote host needs it
        from launcher.transport.ssh import SSHConnection, resolve_host

        command = shlex.join(agent_command(python))
        # Every host's ssh config is decided before any connection, so a refused directive is
        # one error (raised here), not one per host, and nothing connects.
        resolved = {h.entry.name: resolve_host(h.entry.name, user=h.entry.user,
                                               port=h.entry.port, opts=ssh)
                    for _, h in remote}

        def start(host: HostSlots) -> AgentStream | ConnectError:
            try:
                conn = SSHConnection.open(resolved[host.entry.name], ssh)
            except ConnectError as exc:
                return exc
            try:
                stream = conn.exec_stream(command)
            except ConnectError as exc:
                conn.close()
                return exc
            return stream

        workers = max(1, min(ssh.max_parallel, len(remote)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="connect") as pool:
            for (i, _), result in zip(remote, pool.map(start, [h for _, h in remote]),
                                      strict=True):
                results[i] = result
    return [results[i] for i in range(len(selected))]


def close_streams(streams: Sequence[AgentStream]) -> None:
    """Close agent streams and their SSH connections (agents stop on EOF)."""
    for stream in streams:
        stream.close()
        if stream.connection is not None:
            stream.connection.close()
