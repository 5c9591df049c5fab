"""One agent per host over the transport the table names (`transport.table`): for the ssh
launcher each host's own row, a local subprocess or one SSH session (paramiko in the head, or an
`ssh` process with --ssh-client openssh); srun steps for the slurm launcher.

Each remote host is connected and its agent started in one worker, so a host's agent boots
while other hosts are still shaking hands. Agents start no rank until told to, so when any
host fails, closing the others' streams leaves nothing anywhere.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import time
import types
from collections.abc import Sequence

from launcher import wire
from launcher.errors import ConnectError, UnreachableError, UsageError
from launcher.hosts.hostfile import HostEntry
from launcher.hosts.selection import HostSlots
from launcher.transport import table
from launcher.transport.local import agent_command
from launcher.transport.options import SSHOptions
from launcher.transport.stream import AgentStream
from launcher.transport.table import Opened

#: Pauses between rounds of connecting to hosts not reachable yet: the first, the longest.
RETRY_PAUSE_S = (0.5, 5.0)
_SHELL_CHARS = "'\"`$;&|<>\\()*?[]{}!#~"


def validate_remote_python(path: str) -> str:
    """The interpreter path goes into the (constant) remote command: allow only plain paths."""
    if not os.path.isabs(path) or any(c.isspace() or c in _SHELL_CHARS for c in path):
        raise UsageError("unusable interpreter path", "--remote-python", f"{path!r}",
                         "give an absolute path without spaces or shell characters")
    return path


def open_streams(selected: Sequence[HostSlots], *, python: str, ssh: SSHOptions,
                 transport: table.Transport, retry_for: float = 0.0,
                 opened: Opened | None = None) -> list[AgentStream]:
    """Agent streams in host order; ConnectError (nothing left running) if any host fails.
    ``opened`` hears each stream as it opens (`launcher.head.early`, which then keeps them
    alive: no heartbeats of ours meanwhile).

    Hosts that do not resolve or accept connections yet (UnreachableError: a Kubernetes
    worker whose pod or DNS record is not up when the launcher starts) are tried again with
    back-off for up to ``retry_for`` seconds, one line per round naming them, while the agents
    already started hear heartbeats (they would leave after a minute of silence)."""
    deadline = time.monotonic() + retry_for
    results = start_agents(selected, python=python, ssh=ssh, transport=transport,
                           opened=opened)
    pause = RETRY_PAUSE_S[0]
    while True:
        waiting = [i for i, r in enumerate(results) if isinstance(r, UnreachableError)]
        failed = sum(isinstance(r, ConnectError) for r in results) > len(waiting)
        left = deadline - time.monotonic()
        if not waiting or failed or left <= 0:  # a host that refused us fails the launch now
            break
        names = ", ".join(f"{selected[i].entry.name} ({_cause(results[i])})" for i in waiting)
        sys.stderr.write(f"dtrain: {len(waiting)} host(s) not reachable yet: {names}; trying "
                         f"again for {left:.0f}s more (--launch-timeout)\n")
        _keep_alive([r for r in results if not isinstance(r, ConnectError)
                     and opened is None], min(pause, left))
        again = start_agents([selected[i] for i in waiting], python=python, ssh=ssh,
                             transport=transport, opened=None if opened is None else
                             _renumbered(opened, waiting))
        for i, result in zip(waiting, again, strict=True):
            results[i] = result
        pause = min(2 * pause, RETRY_PAUSE_S[1])
    streams = [r for r in results if not isinstance(r, ConnectError)]
    errors = [r for r in results if isinstance(r, ConnectError)]
    if errors:
        close_streams(streams)
        raise errors[0] if len(errors) == 1 else ConnectError(
            f"{len(errors)} hosts could not be reached", "",
            "; ".join(str(e) for e in errors), "nothing was started anywhere")
    return streams


def _renumbered(opened: Opened, indices: Sequence[int]) -> Opened:
    """``opened`` for a start of some hosts: its i-th is host ``indices[i]``."""
    return lambda i, stream: opened(indices[i], stream)


def _cause(error: AgentStream | ConnectError) -> str:
    return error.why if isinstance(error, ConnectError) else ""


def _keep_alive(streams: Sequence[AgentStream], seconds: float) -> None:
    """Wait ``seconds``, with a heartbeat to every started agent at the default interval."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, wire.Watch.heartbeat))
        for stream in streams:
            with contextlib.suppress(OSError, ValueError):  # a broken one shows at start-up
                stream.write(wire.encode(wire.Kind.HEARTBEAT))


def start_agents(selected: Sequence[HostSlots], *, python: str, ssh: SSHOptions,
                 transport: table.Transport,
                 opened: Opened | None = None) -> list[AgentStream | ConnectError]:
    """An agent stream, or why there is none, for every host, in host order, started by a
    dispatching ``transport``, which tells ``opened`` each as it opens; an ssh config that
    cannot be used (a refused directive, a bad name) raises before anything connects."""
    python = validate_remote_python(python)
    results: list[AgentStream | ConnectError] = transport.load()(
        selected, python=python, ssh=ssh, opened=opened or table.not_told)
    return results


def start_by_host(selected: Sequence[HostSlots], *, python: str, ssh: SSHOptions,
                  opened: Opened = table.not_told) -> list[AgentStream | ConnectError]:
    """The ssh launcher: every host by its own row of the table (a loopback name locally, the
    others over the --ssh-client), each kind of host started together, in host order."""
    groups: dict[table.Transport, list[int]] = {}
    for i, host in enumerate(selected):
        groups.setdefault(table.for_host(host.entry, ssh), []).append(i)
    results: dict[int, AgentStream | ConnectError] = {}
    for transport, indices in groups.items():
        started = transport.load()([selected[i].entry for i in indices], python=python,
                                   opts=ssh, opened=_renumbered(opened, indices))
        results.update(zip(indices, started, strict=True))
    return [results[i] for i in range(len(selected))]


def start_paramiko(entries: Sequence[HostEntry], *, python: str, opts: SSHOptions,
                   opened: Opened = table.not_told) -> list[AgentStream | ConnectError]:
    """One paramiko connection and agent channel per host, ``max_parallel`` at a time."""
    import_paramiko(allow_config_exec=opts.allow_config_exec)
    # the thread pool and the SSH modules only when a remote host needs them
    from concurrent.futures import ThreadPoolExecutor

    from launcher.transport.ssh import SSHConnection, resolve_hosts

    command = shlex.join(agent_command(python))
    # Every host's ssh config is decided before any connection, so a refused directive is
    # one error (raised here), not one per host, and nothing connects.
    resolved = dict(zip([e.name for e in entries],
                        resolve_hosts([(e.name, e.user, e.port) for e in entries], opts),
                        strict=True))

    def start(index: int, entry: HostEntry) -> AgentStream | ConnectError:
        try:
            conn = SSHConnection.open(resolved[entry.name], opts)
        except ConnectError as exc:
            return exc
        try:
            stream = conn.exec_stream(command)
        except ConnectError as exc:
            conn.close()
            return exc
        opened(index, stream)
        return stream

    workers = max(1, min(opts.max_parallel, len(entries)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="connect") as pool:
        return list(pool.map(start, range(len(entries)), entries))


def import_paramiko(*, allow_config_exec: bool) -> None:
    """Import paramiko without two costs a launch does not need (on the development VM invoke
    ~0.05 s and the version lookup ~0.015 s, of a launch whose ranks all run after ~0.4 s).

    * invoke: paramiko imports it only to run `Match exec` lines, which are refused unless
      --ssh-allow-config-exec; with that import blocked, paramiko leaves it out.
    * importlib.metadata: paramiko's package `__init__` looks its own version up with it
      (importing it and reading the installed distributions); a stand-in answers from the
      name of paramiko's dist-info folder, and hands over to the real lookup when there is no
      single such folder (another installer's layout).
    """
    if "paramiko" in sys.modules:
        return
    if not allow_config_exec and "invoke" not in sys.modules:
        sys.modules["invoke"] = None  # type: ignore[assignment]  # `import` then fails
    stand_in = None
    if "importlib.metadata" not in sys.modules:
        stand_in = types.ModuleType("importlib.metadata")
        setattr(stand_in, "version", _installed_version)  # noqa: B010 (a module, no class)
        sys.modules["importlib.metadata"] = stand_in
    try:
        import paramiko  # noqa: F401
    finally:
        if stand_in is not None and sys.modules.get("importlib.metadata") is stand_in:
            del sys.modules["importlib.metadata"]


def _installed_version(name: str) -> str:
    """The version in the name of the dist-info folder beside package ``name`` (the layout
    of pip, uv and conda: site-packages/paramiko-5.1.0.dist-info); else importlib.metadata's."""
    package = getattr(sys.modules.get(name), "__file__", None)  # set before its body runs
    site = os.path.dirname(os.path.dirname(package)) if package else ""
    prefix, suffix = f"{name}-", ".dist-info"
    found = [e for e in (os.listdir(site) if site else ())
             if e.startswith(prefix) and e.endswith(suffix)]
    if len(found) == 1:
        return found[0][len(prefix):-len(suffix)]
    sys.modules.pop("importlib.metadata", None)  # the stand-in: the real module from here on
    from importlib import metadata

    return metadata.version(name)


def close_streams(streams: Sequence[AgentStream]) -> None:
    """Close agent streams and their SSH connections (agents stop on EOF).

    The connections whose close waits (paramiko's joins its transport thread: ``slow_close``)
    close together: one after the other the job's exit tail grew with every host. The others
    (a relayed host's, an `ssh` process's, a simulated host's) close at once, here: a pool's
    threads for 1,024 of those were up to 1.4 s of the simulated exit tail at 512 hosts on a
    loaded machine (`bench.sim_scale`)."""
    for stream in streams:
        stream.close()
    connections = [s.connection for s in streams if s.connection is not None]
    slow = [c for c in connections if getattr(c, "slow_close", False)]
    for connection in connections:
        if len(slow) < 2 or not getattr(connection, "slow_close", False):
            connection.close()
    if len(slow) < 2:
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(32, len(slow)),
                            thread_name_prefix="close") as pool:
        list(pool.map(lambda connection: connection.close(), slow))
