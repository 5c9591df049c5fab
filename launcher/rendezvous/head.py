"""The `rendezvous` row of the transport table: the head waits for N agents to join, and
hands the launch their hosts and streams (the join flow of `launcher.launch`).

Each joined agent is a host named by its host name, with --nproc-per-node slots, else as many
as it counted GPUs (one without any), in the roster's order (--node-rank, else host name);
--include/--exclude choose among them as among a hostfile's hosts. From here the job runs as
over SSH: the same SPEC, start, PMI, output, supervision and report.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass

from launcher import wire
from launcher.errors import UsageError
from launcher.hosts.hostfile import HostEntry
from launcher.hosts.selection import HostSlots, select_hosts
from launcher.rendezvous.listener import Listener
from launcher.rendezvous.options import RendezvousOptions, read_token
from launcher.rendezvous.roster import Roster
from launcher.transport.stream import AgentStream


@dataclass
class Joined:
    """The hosts that joined, their streams in the same order, and the still open listener
    (late agents are refused; `listener.vacate` is the restart hook)."""

    selected: list[HostSlots]
    streams: list[AgentStream]
    listener: Listener

    def close(self, why: str) -> None:
        """No more agents; any still waiting are told ``why``."""
        self.listener.close(why)

    def abandon(self, why: str) -> None:
        """The job will not start after all: every joined agent is told ``why`` and leaves."""
        for stream in self.streams:
            with contextlib.suppress(OSError):
                stream.write(wire.encode_json(wire.Kind.REFUSE, {"why": why}))
            stream.kill()
        self.close(why)


def join_agents(opts: RendezvousOptions | None, *, include: str | None, exclude: str | None,
                nproc_per_node: int | None, heartbeat: float) -> Joined:
    """Listen, wait for --nnodes agents within --rendezvous-timeout, and place them (the
    filters and --nproc-per-node as the launch has them; heartbeats to the waiting agents)."""
    if opts is None:
        raise UsageError("rendezvous mode needs its port and node count", "--launcher "
                         "rendezvous", "no --rendezvous-port/--nnodes was given",
                         "add --rendezvous-port PORT --nnodes N --token-file F")
    token = read_token(opts.token_file)
    roster = Roster(opts.nnodes, include=include, exclude=exclude)
    listener = Listener(opts, token, roster)
    sys.stderr.write(f"dtrain: waiting for {opts.nnodes} agent(s) on {listener.shown} "
                     f"(up to {opts.timeout:g}s)\n")
    try:
        joined = listener.wait(time.monotonic() + opts.timeout, heartbeat)
        entries = [HostEntry(arrival.host, nproc_per_node or arrival.gpus or 1,
                             source=f"agent at {arrival.address}") for arrival, _ in joined]
        selected = select_hosts(entries, include=include, exclude=exclude, unknown_ok=True)
    except BaseException as exc:
        listener.close(f"the head stopped before the start: {_why(exc)}")
        raise
    used = {host.entry.name for host in selected}
    streams: list[AgentStream] = []
    for arrival, stream in joined:
        if arrival.host in used:
            streams.append(stream)
        else:  # a filter took every slot it had: it has no part in the job
            stream.kill()
    return Joined(selected, streams, listener)


def _why(exc: BaseException) -> str:
    return "interrupted (Ctrl-C)" if isinstance(exc, KeyboardInterrupt) else str(exc)
