"""What an agent tells the head about its host: HELLO facts and answers to QUERY frames."""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

from launcher import __version__, wire
from launcher.netroute import free_port, route_source

_PACKAGES = ("torch", "mpi4py", "mpich", "paramiko")


def hello() -> dict[str, Any]:
    return {
        "protocol": wire.PROTOCOL_VERSION,
        "dtrain": __version__,
        "hostname": socket.gethostname(),
        "python": ".".join(map(str, sys.version_info[:3])),
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


def host_facts(cwd: str) -> dict[str, Any]:
    """Versions and resources for `dtrain check` (package versions read without importing)."""
    from importlib import metadata  # only `dtrain check` needs it: keep it off the start path

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
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, timeout=20, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sum(1 for line in out.decode(errors="replace").splitlines() if line.startswith("GPU "))
