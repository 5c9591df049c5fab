"""The agent process around its event loop: signals (the head decides about Ctrl-C), the child
subreaper, and an exit that waits briefly for the last frames to reach the head. The same for
an agent the head started (`python -m launcher.agent`, its stdio the stream) and for one that
joined it (`dtrain agent --rendezvous`, a sealed socket the stream)."""

from __future__ import annotations

import os
import queue
import signal
import sys

from launcher.agent import descendants
from launcher.agent.head_link import Eof, HeadLink
from launcher.agent.main import Agent

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, NoReturn

FLUSH_S = 2.0  # leaving: how long queued frames may take to reach the head


def serve(connect: Callable[[queue.Queue[Any]], HeadLink]) -> NoReturn:
    """Run the agent over the link ``connect`` makes, then exit with its code."""
    # Ctrl-C in the head's terminal must not reach a local agent directly: the head decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    descendants.become_subreaper()  # orphans of the job stay findable (descendants.py)
    agent = Agent(connect)
    signal.signal(signal.SIGTERM, lambda *_: agent.events.put(Eof("the agent got SIGTERM")))
    code = run(agent)
    sys.stderr.flush()
    os._exit(code)


def run(agent: Agent) -> int:
    """The agent's loop to its end; then, as a relay, its subtree's streams carried to theirs;
    then the last frames flushed. Its exit code (the simulated cluster runs its agents so)."""
    code = agent.run()
    if agent.relay is not None:  # a relay carries its subtree's streams to their end
        if not agent.head_gone:
            agent.relay.linger(agent.events, lambda event: isinstance(event, Eof))
        agent.relay.close()
    agent.link.flush(FLUSH_S)  # EXIT/DONE frames still queued; the head may still be reading
    return code
