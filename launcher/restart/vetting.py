"""Before a restart: every host of the next round has a live agent that can run the job.

A host whose agent is gone (a lost host used again for want of a spare, a spare that fell
silent or was not reached at start, an agent that fell silent during the back-off) is connected
again; a spare's return, or its failure to return, is one line. A spare whose check of the job
failed (its SPEC without ranks got ERROR) cannot take a place. With `--restart-check` a spare
that is about to take a place first answers the `dtrain check` probes (versions, the ranks'
python, the working directory, GPUs against its slots), compared with the head's own. The first
host that fails is returned as a `Blame`, so the pool places the round again without it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from launcher import wire
from launcher.errors import ConnectError
from launcher.head.agent_link import AgentLink, Fleet
from launcher.head.startup import Signalled
from launcher.hosts.selection import HostSlots
from launcher.plan.environment import program_env
from launcher.restart.blame import Blame
from launcher.restart.policy import RestartOptions
from launcher.restart.pool import HostPool, NextRound
from launcher.transport.stream import AgentStream


class SetupView(Protocol):
    """What vetting reads of the job's shared setup (`launcher.restart.rounds.RoundsSetup`)."""

    @property
    def cwd(self) -> str: ...
    @property
    def base_env(self) -> Mapping[str, str]: ...
    @property
    def restart(self) -> RestartOptions: ...
    @property
    def connect(self) -> Callable[[Sequence[HostSlots]], list[AgentStream | ConnectError]]: ...


class Rounds(Protocol):
    """What vetting uses of the rounds between two of them (`launcher.restart.rounds.Rounds`,
    which calls it: a protocol, so that the two modules do not import each other)."""

    links: dict[str, AgentLink]
    fleet: Fleet
    pool: HostPool

    @property
    def setup(self) -> SetupView: ...
    def say(self, text: str) -> None: ...
    def tend(self, seconds: float, done: Callable[[], bool] = ...) -> int | None: ...

CHECK_TIMEOUT_S = 30.0  # how long a replacement may take to answer the check probes


def vet(rounds: Rounds, nxt: NextRound) -> Blame | None:
    """The first host of ``nxt`` that cannot run the next round, blamed; None when all can."""
    incoming = {new for _, new in nxt.replaced}
    for host in nxt.hosts:
        name = host.entry.name
        link = rounds.links.get(name)
        if link is None or not link.alive:
            result = _connect(rounds, host)
            if isinstance(result, ConnectError):
                if name in incoming:
                    rounds.say(f"spare {name} is still gone: {result}")
                return Blame("host lost", (name,), (name,),
                             f"host {name}: cannot be reached again: {result}")
            rounds.links[name] = rounds.fleet.add(result)
            if name in incoming:
                rounds.pool.spare_back(name)
                rounds.say(f"spare {name} is back (connected again)")
            continue
        problem = rounds.fleet.checked.get(link.index)
        if problem:
            return Blame("spare check", (name,), (name,), f"host {name}: {problem}")
        if rounds.setup.restart.restart_check and name in incoming:
            problems = _probe(rounds, link, len(host.slots))
            if problems:
                return Blame("restart check", (name,), (name,),
                             f"host {name}: {'; '.join(problems)}")
    return None


def _connect(rounds: Rounds, host: HostSlots) -> AgentStream | ConnectError:
    """Connect to ``host`` again on a thread, the other agents kept alive meanwhile (an SSH
    connection can take its whole timeout; they would take the head for gone)."""
    done: list[AgentStream | ConnectError] = []
    thread = threading.Thread(target=lambda: done.extend(rounds.setup.connect([host])),
                              name="reconnect", daemon=True)
    thread.start()
    _hold_signal(rounds, rounds.tend(float("inf"), lambda: bool(done)))
    thread.join()
    return done[0]


def _hold_signal(rounds: Rounds, signum: int | None) -> None:
    """A signal while vetting waits for the next round's start-up, which acts on it."""
    if signum is not None:
        rounds.fleet.events.put(Signalled(signum))


def _probe(rounds: Rounds, link: AgentLink, slots: int) -> list[str]:
    """`dtrain check`'s comparison of ``link``'s host with the head's (what differs)."""
    from launcher.agent.facts import host_facts
    from launcher.check import compare

    setup, fleet = rounds.setup, rounds.fleet
    planned = program_env(setup.base_env)  # a spare starts no ranks: no secrets
    fleet.replies.pop(link.index, None)
    link.send_json(wire.Kind.QUERY, {"op": "facts", "cwd": setup.cwd, "env": planned})
    _hold_signal(rounds, rounds.tend(CHECK_TIMEOUT_S, lambda: link.index in fleet.replies
                                     or not link.alive))
    reply = fleet.replies.get(link.index)
    if reply is None or "error" in reply:
        return [f"no answer to the check probes ({(reply or {}).get('error', 'timed out')})"]
    return compare(host_facts(setup.cwd, planned), reply, slots)
