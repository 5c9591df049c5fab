"""Simulated hosts joining a rendezvous head (`testbed.simcluster --join`): each one the real
`dtrain agent --rendezvous` path (`launcher.rendezvous.join`: connect, token handshake, JOIN,
ADMIT, then the agent over the sealed channel), many to a process, each under its own host
name and from its own loopback address.
"""

from __future__ import annotations

import socket
import sys
import threading
import types
from typing import Any


def join_host(name: str, where: tuple[str, int], token_file: str, hosts: Any,
              codes: dict[str, int], timeout: float) -> None:
    """One simulated host in rendezvous mode: the real join (`launcher.rendezvous.join`:
    connect, token handshake, JOIN, ADMIT), then the real agent over the sealed channel, as
    `dtrain agent --rendezvous` runs it. The host's name is the thread's (`_named_socket`);
    ``hosts(name)`` its `launcher.agent.host.Host` (`testbed.simcluster`)."""
    from launcher.agent.head_link import HeadLink
    from launcher.rendezvous import join
    from launcher.rendezvous.options import JoinOptions, read_token

    _NAMES.name = name
    number = int("".join(c for c in name if c.isdigit()) or 0)
    _NAMES.address = f"127.{1 + number // 62500}.{number // 250 % 250}.{1 + number % 250}"
    try:
        sealed = join.join(JoinOptions(where[0], where[1], token_file, timeout=timeout),
                           read_token(token_file))
    except Exception as exc:  # noqa: BLE001 - one host that could not join is a result
        sys.stderr.write(f"simcluster: {name} did not join: {exc}\n")
        codes[name] = -1
        return
    from testbed.simcluster import run_agent

    codes[name] = run_agent(lambda events: HeadLink(events, sealed.read, sealed), hosts(name))
    try:  # as the agent process's exit closes its connection
        sealed.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sealed.sock.close()


_NAMES = threading.local()


def _named_socket() -> Any:
    """`socket` as `launcher.rendezvous.join` sees it here: gethostname answers the simulated
    host's name, and its connections leave from an address of its own in 127.0.0.0/8 (all
    loopback on Linux), as real hosts' do: the head's gate limits unproved connections per
    address, which one shared address would turn into a queue of refusals."""
    named = types.ModuleType("socket")
    named.__dict__.update(socket.__dict__)

    def gethostname() -> str:
        return getattr(_NAMES, "name", socket.gethostname())

    def create_connection(address: tuple[str, int], timeout: Any = None,
                          source_address: Any = None) -> socket.socket:
        own = getattr(_NAMES, "address", None)
        return socket.create_connection(address, timeout, (own, 0) if own else source_address)

    named.gethostname = gethostname  # type: ignore[attr-defined]
    named.create_connection = create_connection  # type: ignore[attr-defined]
    return named


def use_named_sockets() -> None:
    """`launcher.rendezvous.join` in this process sees `_named_socket`."""
    from launcher.rendezvous import join

    join.socket = _named_socket()  # type: ignore[attr-defined]
