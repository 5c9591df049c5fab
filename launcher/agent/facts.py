"""What an agent tells the head about its host: HELLO facts and answers to QUERY frames."""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from typing import Any

from launcher import __version__, wire

_PACKAGES = ("torch", "mpi4py", "mpich", "paramiko")


def hello() -> dict[str, Any]:
    return {
        "protocol": wire.PROTOCOL_VERSION,
        "dtrain": __version__,
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "pid": os.getpid(),
    }


def answer(query: dict[str, Any]) -> dict[str, Any]:
    """Answer one QUERY; an unknown op gets an error reply rather than silence."""
    op = query.get("op")
    try:
        if op == "route_source":
            return {"op": op, "address": route_source(str(query["dest"]))}
        if op == "free_port":
            return {"op": op, "port": free_port()}
        if op == "facts":
            return {"op": op, **host_facts(str(query.get("cwd", "")))}
    except (OSError, KeyError, ValueError) as exc:
        return {"op": op, "error": str(exc)}
    return {"op": op, "error": f"unknown query {op!r}"}


def route_source(dest: str) -> str:
    """The local address the kernel would use to reach ``dest``: reachable from there."""
    family = socket.AF_INET6 if ":" in dest else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((dest, 9))  # UDP connect sends nothing; it only picks the route
        return s.getsockname()[0]


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
        return s.getsockname()[1]


def host_facts(cwd: str) -> dict[str, Any]:
    """Versions and resources for `dtrain check` (package versions read without importing)."""
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        **hello(),
        "versions": versions,
        "gpus": gpu_count(),
        "cwd_exists": bool(cwd) and os.path.isdir(cwd),
    }


def gpu_count() -> int | None:
    """GPUs `nvidia-smi -L` lists, or None when there is no nvidia-smi on this host."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, timeout=20, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sum(1 for line in out.decode(errors="replace").splitlines() if line.startswith("GPU "))
