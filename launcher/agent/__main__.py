"""Entry point of the agent: `python -m launcher.agent` (the head starts it; not for users).

The process around the `Agent` event loop: signals (the head decides about Ctrl-C), the child
subreaper, and an exit that waits briefly for the last frames to reach the head.
"""

import os
import signal
import sys

from launcher.agent import descendants
from launcher.agent.head_link import Eof
from launcher.agent.main import Agent

FLUSH_S = 2.0  # leaving: how long queued frames may take to reach the head


def main() -> None:
    # Ctrl-C in the head's terminal must not reach a local agent directly: the head decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    descendants.become_subreaper()  # orphans of the job stay findable (descendants.py)
    agent = Agent()
    signal.signal(signal.SIGTERM, lambda *_: agent.events.put(Eof("the agent got SIGTERM")))
    code = agent.run()
    agent.link.flush(FLUSH_S)  # EXIT/DONE frames still queued; the head may still be reading
    sys.stderr.flush()
    os._exit(code)


main()
