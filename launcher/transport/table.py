"""Every way dtrain reaches its agents, in one table; `launch`, `check` and the command line ask
it, never a name.

    name        flow      chosen by          entry
    ssh         dispatch  --launcher         each host by its own row below (local or a client)
    slurm       dispatch  --launcher         one srun step per host
    mpirun      command   --launcher         an mpiexec/mpirun command runs the ranks, no agents
    rendezvous  join      --launcher         agents started elsewhere join the head over TCP
    local       host      a loopback name    a subprocess of the head
    paramiko    host      --ssh-client       an SSH session channel, paramiko in the head
    openssh     host      --ssh-client       one system `ssh` process per host

A row names its entry as ``module:function``, imported only when the row is used: a launch
pays for the transport it uses and no other (paramiko, srun and the rendezvous listener each
cost the head's start-up). What the entry takes and returns depends on the row's flow (the
`Flow` members say). Adding a transport is its own module plus one row here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from launcher.errors import UsageError

if TYPE_CHECKING:
    from launcher.hosts.hostfile import HostEntry
    from launcher.transport.options import SSHOptions
    from launcher.transport.stream import AgentStream

#: What a dispatch or host entry tells as each host's stream opens: (its index among the hosts
#: it was given, the stream), from whichever thread opened it.
Opened = Callable[[int, "AgentStream"], None]


def not_told(index: int, stream: AgentStream) -> None:
    """The `Opened` of a start nobody listens to."""


class Flow(enum.Enum):
    """How a launch goes with a transport, and so what its entry is."""

    #: The head starts an agent on every host it was given, telling ``opened`` each stream as
    #: it opens (`launcher.head.early`): ``(selected: Sequence[HostSlots], *, python, ssh,
    #: opened) -> list[AgentStream | ConnectError]``.
    DISPATCH = "dispatch"
    #: Agents started by something else connect to the head; the hosts are whoever joined:
    #: ``(opts, *, include, exclude, nproc_per_node, heartbeat) -> rendezvous.head.Joined``.
    JOIN = "join"
    #: Another launcher runs the ranks, with no agents:
    #: ``(req: LaunchRequest, plan: JobPlan, selected) -> exit code``.
    COMMAND = "command"
    #: How the ssh launcher reaches one kind of host: ``(entries: Sequence[HostEntry], *,
    #: python, opts, opened) -> Sequence[AgentStream | ConnectError]``.
    HOST = "host"


@dataclass(frozen=True)
class Transport:
    """One row of the table."""

    name: str                 # what the user writes after its option (--launcher, --ssh-client)
    flow: Flow
    summary: str              # what --help says of it
    entry: str                # "module:function" that starts it; signature by `flow`
    checks: bool = False      # `dtrain check` can reach hosts this way
    explain: str = ""         # "module:function" -> str | None: after a failed job, whether
                              # the transport's own system ended it (Slurm's scancel, limits)
    relays: str = ""          # dispatch rows: "module:function" -> the hop a relay needs to
                              # start each host below it (`launcher.tree`), as
                              # ``(entries, ssh) -> list[dict]``; "" for a flat launch only

    def load(self) -> Callable[..., Any]:
        """The entry function, its module imported now."""
        return _function(self.entry)

    def load_relays(self) -> Callable[..., Any]:
        """The hop describer of a fan-out over this transport (`relays`)."""
        return _function(self.relays)

    def explain_failure(self) -> str | None:
        """One line on why the job ended when the transport's own system ended it, else None."""
        return _function(self.explain)() if self.explain else None


TRANSPORTS: tuple[Transport, ...] = (
    Transport("ssh", Flow.DISPATCH, "dtrain's agents over SSH (localhost as a subprocess)",
              "launcher.transport.connect:start_by_host", checks=True,
              relays="launcher.tree.hops:describe"),
    Transport("slurm", Flow.DISPATCH, "dtrain's agents as srun steps, in a Slurm allocation",
              "launcher.slurm.srun:start_agents", checks=True,
              explain="launcher.slurm.srun:slurm_ended_job"),
    Transport("mpirun", Flow.COMMAND, "an mpiexec/mpirun command runs the ranks",
              "launcher.mpirun.job:run_job"),
    Transport("rendezvous", Flow.JOIN, "agents started elsewhere (`dtrain agent "
              "--rendezvous`) join the head", "launcher.rendezvous.head:join_agents"),
    Transport("local", Flow.HOST, "a subprocess of the head, for a loopback host name",
              "launcher.transport.local:start_agents"),
    Transport("paramiko", Flow.HOST, "paramiko in dtrain", "launcher.transport.connect:"
              "start_paramiko"),
    Transport("openssh", Flow.HOST, "the system `ssh` command (starts faster; uses ssh's own "
              "config, keys and agent)", "launcher.transport.openssh.session:start_agents"),
)
#: The --launcher rows and their default, and the --ssh-client rows.
DEFAULT_LAUNCHER = "ssh"
LAUNCHER_FLOWS = (Flow.DISPATCH, Flow.COMMAND, Flow.JOIN)
SSH_CLIENTS = tuple(t.name for t in TRANSPORTS if t.flow is Flow.HOST and t.name != "local")


def get(name: str, option: str = "--launcher") -> Transport:
    """The row called ``name``; a UsageError naming ``option`` and the choices otherwise."""
    for transport in TRANSPORTS:
        if transport.name == name:
            return transport
    known = ", ".join(t.name for t in TRANSPORTS)
    raise UsageError("unknown transport", option, f"{name!r} is not one of {known}",
                     "choose one of them")


def launchers(*, checks: bool = False) -> list[str]:
    """The --launcher choices (of `dtrain check` when ``checks``), in the table's order."""
    return [t.name for t in TRANSPORTS
            if t.flow in LAUNCHER_FLOWS and (t.checks or not checks)]


def of_flow(flow: Flow) -> Transport:
    """The first row of ``flow`` (the join flow has one: what --rendezvous-port selects)."""
    return next(t for t in TRANSPORTS if t.flow is flow)


def for_host(entry: HostEntry, ssh: SSHOptions) -> Transport:
    """How the ssh launcher reaches one host: a loopback name locally, else the SSH client."""
    return get("local") if entry.is_local else get(ssh.client, "--ssh-client")


def helps(names: Sequence[str]) -> str:
    """``name: summary`` of each row, for an option's --help."""
    return "; ".join(f"{name}: {get(name).summary}" for name in names)


def _function(entry: str) -> Callable[..., Any]:
    module, _, name = entry.partition(":")
    # The import statement's own path (importlib.import_module skips it): the same import,
    # and `python -X importtime` lists the module as it lists every other.
    function: Callable[..., Any] = getattr(__import__(module, fromlist=[name]), name)
    return function
