"""The per-host agent (`python -m launcher.agent`): starts, watches and stops one host's ranks."""
