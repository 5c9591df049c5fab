"""Entry point of the agent: `python -m launcher.agent` (the head starts it; not for users).
Its stdin and stdout are the stream to the head (`launcher.agent.serve`)."""

from launcher.agent.head_link import HeadLink
from launcher.agent.serve import serve

serve(HeadLink.over_stdio)
