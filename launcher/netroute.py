"""Which local address and interface reach a destination; a free port (socket helpers)."""

from __future__ import annotations

import socket


def route_source(dest: str) -> str:
    """The local address the kernel would use to reach ``dest``: reachable from there."""
    family = socket.AF_INET6 if ":" in dest else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((dest, 9))  # UDP connect sends nothing; it only picks the route
        return str(s.getsockname()[0])


def interface_for(dest: str) -> str | None:
    """The network interface this host uses to reach ``dest`` (IPv4), or None if unknown.

    Gloo and NCCL pick an interface from the host name or by a first-fit rule, which on
    hosts with bridges, veths or docker0 often is not the one that reaches rank 0.
    """
    import fcntl
    import struct

    try:
        source = route_source(dest)
    except OSError:
        return None
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                packed = fcntl.ioctl(s.fileno(), siocgifaddr, request)
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == source:
                return name
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
