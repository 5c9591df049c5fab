"""How to reach hosts over SSH: the options `dtrain launch` and `dtrain check` take.

Kept apart from the SSH modules so the command line builds them without importing paramiko
(only a launch with a remote host needs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

#: Which SSH client carries the agents: paramiko in the head, or the system `ssh` command.
SSHClient = Literal["paramiko", "openssh"]


@dataclass(frozen=True)
class SSHOptions:
    """How to reach hosts; one instance per launch (CLI options map onto these fields)."""

    config_file: Path | None = None      # None -> ~/.ssh/config when it exists
    known_hosts: Path | None = None      # None -> UserKnownHostsFile from config, else ~/.ssh/
    accept_new: bool = False             # opt-in TOFU; a CHANGED key is always refused
    connect_timeout: float = 10.0
    banner_timeout: float = 15.0
    auth_timeout: float = 30.0
    keepalive: float = 15.0
    max_parallel: int = 32               # bounded parallel handshakes
    allow_config_exec: bool = False      # Match exec, ProxyCommand, ... refused unless True
    handshake_timeout: float = 30.0      # banner + key exchange, whole
    channel_timeout: float = 30.0        # opening a session channel
    client: SSHClient = "paramiko"       # openssh: `ssh` processes, no paramiko import
