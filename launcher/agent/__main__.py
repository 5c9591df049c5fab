"""Entry point of the agent: `python -m launcher.agent` (the head starts it; not for users)."""

from launcher.agent.main import main

main()
