"""Byte streams to the per-host agents: the AgentStream protocol, a local pipe, SSH."""
