"""Rendezvous mode's settings, head and agent side (the defaults are written here only), and
the shared token, read from its file with the checks a secret needs.

    dtrain launch --rendezvous-port PORT --nnodes N --token-file F -- PROGRAM   (the head)
    dtrain agent --rendezvous HOST:PORT --token-file F                          (every node)

The token file is what a Kubernetes Secret volume or a user's own file holds: whitespace
around the token is ignored; the token must be one `dtrain token new` made (`tokens`: 256
random bits, so it cannot be guessed), and the file a regular file (a link to one is followed:
a Secret's files are links), owned by this user or root, giving others no access and its group
no write (group read is what a Secret gets under fsGroup).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from launcher.errors import UsageError
from launcher.hosts.names import validate_host_name
from launcher.rendezvous import tokens

MAX_TOKEN_BYTES = 4096   # read at most this much: a token file is one short line
#: Environment variables `dtrain agent` (and the head's --token-file) read when the option is
#: not given: what a pod template or a batch script sets once for every node.
ENV_ENDPOINT = "DTRAIN_RDZV_ENDPOINT"
ENV_TOKEN_FILE = "DTRAIN_RDZV_TOKEN_FILE"
ENV_NODE_RANK = "DTRAIN_RDZV_NODE_RANK"
ENV_TIMEOUT = "DTRAIN_RDZV_TIMEOUT"
TOKEN_FIX = (f"give the file holding the job's shared token: {tokens.MAKE_ONE}; Kubernetes: "
             "`kubectl create secret generic dtrain-token --from-file=token`, mounted with "
             "defaultMode: 0400")


@dataclass(frozen=True)
class RendezvousOptions:
    """The head's side: where it listens and how many agents it waits for."""

    port: int                       # --rendezvous-port
    nnodes: int                     # --nnodes: agents to wait for
    token_file: str                 # --token-file
    host: str = ""                  # --rendezvous-host: the address to listen on; "": all
    timeout: float = 600.0          # --rendezvous-timeout: seconds to wait for the agents


@dataclass(frozen=True)
class JoinOptions:
    """An agent's side: where the head is, and how long to keep trying it."""

    host: str                       # the head's name or address (--rendezvous HOST:PORT)
    port: int
    token_file: str                 # --token-file
    node_rank: int | None = None    # --node-rank: this node's place; None: by host name
    timeout: float = RendezvousOptions.timeout  # --join-timeout: seconds to keep trying


def parse_endpoint(text: str, where: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT`` as (host, port); UsageError naming ``where`` else."""
    host, colon, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not colon or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError("bad rendezvous address", where, f"{text!r} is not HOST:PORT",
                         "write the head's address and --rendezvous-port, e.g. head-0:29400")
    validate_host_name(host, where)
    return host, int(port)


def read_token(path: str) -> bytes:
    """The shared token in ``path``; one UsageError naming the file and the fix otherwise."""
    where = f"--token-file {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise UsageError("cannot read the token file", where, exc.strerror or str(exc),
                         TOKEN_FIX) from None
    try:
        info = os.fstat(fd)  # of the file opened, not of a path that could change meanwhile
        _check_file(info, where)
        data = os.read(fd, MAX_TOKEN_BYTES + 1)
    finally:
        os.close(fd)
    token = data.strip()
    try:
        why = "it is longer than a token" if len(data) > MAX_TOKEN_BYTES else tokens.why_not(
            token.decode("ascii"))
    except UnicodeDecodeError:
        why = "it is not text"
    if why:
        raise UsageError("unusable token", where, why, TOKEN_FIX)
    return token


def _check_file(info: os.stat_result, where: str) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise UsageError("the token file is not a regular file", where,
                         "a token is read from a plain file only", TOKEN_FIX)
    if info.st_uid not in (os.geteuid(), 0):
        raise UsageError("the token file belongs to another user", where,
                         f"owner uid {info.st_uid}: whoever owns it can change the token",
                         f"use a file of your own; {TOKEN_FIX}")
    mode = stat.S_IMODE(info.st_mode)
    if mode & (stat.S_IRWXO | stat.S_IWGRP):
        raise UsageError("the token file is open to other users", where,
                         f"mode {mode:04o} lets others read or change the shared token",
                         f"chmod 600 {where.split(' ', 1)[1]}")
