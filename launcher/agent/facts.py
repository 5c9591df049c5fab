"""What an agent tells the head about its host: HELLO facts, answers to QUERY frames, and
rank 0's host's choice of the rendezvous (in its READY).

For `dtrain check` it also resolves `python` with the PATH a rank would get (the head's
forwarded PATH in front of this host's, `launcher.plan.environment.rank_environment`), so the
head can flag a host where the ranks' `python` is not the head's.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Mapping

from launcher import STARTED, __version__, wire
from launcher.agent.ranks import find_program
from launcher.netroute import free_port, route_source
from launcher.plan.environment import rank_environment

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from typing import Any

_PACKAGES = ("torch", "mpi4py", "mpich", "paramiko")
#: The program `dtrain check` resolves as a rank would (the README's `-- python ...`).
RANK_PROGRAM = "python"
#: Forwarded variables naming an environment directory that should exist on every host.
PREFIX_VARIABLES = ("VIRTUAL_ENV", "CONDA_PREFIX")


def hello() -> dict[str, Any]:
    return {
        "protocol": wire.PROTOCOL_VERSION,
        "dtrain": __version__,
        "hostname": socket.gethostname(),
        "python": ".".join(map(str, sys.version_info[:3])),
        "executable": sys.executable,
        "pid": os.getpid(),
        # From the agent's first import to now: its imports, the bulk of its start-up.
        "boot_s": round(time.monotonic() - STARTED, 4),
    }


def rendezvous(probe: wire.Probe | None) -> dict[str, Any]:
    """Rank 0's host picks the rendezvous: its address towards the next host, a free port."""
    found: dict[str, Any] = {}
    if probe is None:
        return found
    try:
        if probe.route_to:
            found["address"] = route_source(probe.route_to)
        if probe.free_port:
            found["port"] = free_port()
    except OSError as exc:
        found["probe_error"] = str(exc)
    return found


def answer(query: dict[str, Any]) -> dict[str, Any]:
    """Answer one QUERY; an unknown op gets an error reply rather than silence."""
    op = query.get("op")
    try:
        if op == "route_source":
            return {"op": op, "address": route_source(str(query["dest"]))}
        if op == "free_port":
            return {"op": op, "port": free_port()}
        if op == "facts":
            planned = {str(k): str(v) for k, v in (query.get("env") or {}).items()}
            return {"op": op, **host_facts(str(query.get("cwd", "")), planned)}
    except (OSError, KeyError, ValueError) as exc:
        return {"op": op, "error": str(exc)}
    return {"op": op, "error": f"unknown query {op!r}"}


def host_facts(cwd: str, planned: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Versions and resources for `dtrain check` (package versions read without importing);
    ``planned``: the forwarded variables (PATH, VIRTUAL_ENV, ...) a rank would get."""
    from importlib import metadata  # only `dtrain check` needs it: keep it off the start path

    versions: dict[str, str | None] = {}
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
        **rank_python(planned or {}, cwd),
    }


def rank_python(planned: Mapping[str, str], cwd: str) -> dict[str, Any]:
    """Which `python` a rank's argv[0] would run here, and which forwarded prefixes are absent."""
    env = rank_environment(os.environ, planned)
    found = find_program(RANK_PROGRAM, env, cwd if os.path.isdir(cwd) else "/")
    missing = [f"{name} {planned[name]}" for name in PREFIX_VARIABLES
               if planned.get(name) and not os.path.isdir(planned[name])]
    return {"rank_python": found, "missing_prefixes": missing}


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
