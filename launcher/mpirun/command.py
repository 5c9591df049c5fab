"""`dtrain launch --launcher mpirun`: the same hosts, filters and environment as an MPI command.

For Open MPI clusters (Open MPI 5 speaks only PMIx, not the PMI-1 dtrain serves) and for sites
that want their MPI's own launcher. MPICH Hydra gets `-hosts h:n,... -genvlist K,...`, Open MPI
gets `--hostfile F --map-by slot -x K ...`: the variables' values travel in the environment of
the mpiexec/mpirun process and only their names on its command line, which every local user can
read (`ps`) for as long as the job runs, so a forwarded HF_TOKEN never appears there.

Rank variables (RANK, LOCAL_RANK...) cannot be set per rank by these launchers, so the program
runs under `python -E -P -m launcher.mpirun.rankshim --`, which derives them from the MPI
launcher's own variables, sets GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME per host and makes a failing
rank end the whole job (see its docstring), as dtrain's agents do.

Addresses follow the SSH launcher's rule (`launcher.head.startup`): MASTER_ADDR is rank 0's
host as the others reach it (with the head as rank 0's host: its address on the route to the
next host; 127.0.0.1 for a single local host). Hydra's proxies connect back to mpiexec at the
head's host name, which on a multi-homed head may resolve to an interface the hosts cannot
reach, so Hydra is given ``-localhost`` with the head's address on the route to the hosts.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from launcher import netroute
from launcher.errors import UsageError
from launcher.hosts.hostfile import HostEntry
from launcher.plan.job import JobPlan, Rendezvous
from launcher.transport.local import python_module

FLAVOURS = ("hydra", "openmpi")


@dataclass(frozen=True)
class Addresses:
    """Where the job meets: rank 0's address for the ranks, the head's for Hydra's proxies."""

    master_addr: str
    head_addr: str | None = None   # None: every host is local, nothing connects back


@dataclass(frozen=True)
class MpiCommand:
    #: The command line: variable names only, never their values.
    argv: tuple[str, ...]
    #: The job's shared variables, set in the MPI launcher's own environment, which forwards
    #: the ones argv names to every rank.
    env: Mapping[str, str] = field(default_factory=dict)
    #: Open MPI: written to a temporary file at run time.
    hostfile_text: str | None = None

    def shown(self) -> str:
        """The command as a shell line, values included: for --dry-run, shown to its user."""
        assignments = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        return " ".join([*assignments, shlex.join(self.argv)])


def detect_flavour(mpirun: str) -> str:
    """Which MPI launcher `mpirun` is, from its --version banner."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError("cannot run the MPI launcher", mpirun, str(exc),
                         "install MPI or pass --mpirun PATH") from None
    banner = out.stdout + out.stderr
    if "Open MPI" in banner or "OpenRTE" in banner or "PRRTE" in banner:
        return "openmpi"
    if "HYDRA" in banner or "MPICH" in banner or "Intel(R) MPI" in banner:
        return "hydra"
    raise UsageError("unknown MPI launcher", mpirun, f"--version says {banner[:80]!r}",
                     "pass --mpi-flavour hydra or openmpi")


def shared_env(plan: JobPlan, rendezvous: Rendezvous) -> dict[str, str]:
    """Variables equal on every rank: the base environment plus the job-wide contract."""
    return {**plan.base_env, **plan.job_env(), **rendezvous.env()}


def addresses(hosts: Sequence[HostEntry], master_addr: str | None) -> Addresses:
    """The rendezvous and control addresses for ``hosts`` as routed from this (head) host."""
    remote = [h for h in hosts if not h.is_local]
    try:
        head = netroute.route_source(remote[0].name) if remote else None
    except OSError as exc:
        raise UsageError("no route to host", remote[0].source or remote[0].name, str(exc),
                         "use a name this host resolves (mpiexec's ssh reads ~/.ssh/config, "
                         "dtrain cannot) or an address") from None
    if master_addr:
        return Addresses(master_addr, head)
    first = hosts[0]
    if not first.is_local:
        return Addresses(first.name, head)
    return Addresses(head or "127.0.0.1", head)


def build_command(plan: JobPlan, rendezvous: Rendezvous, *, mpirun: str, flavour: str,
                  python: str, head_addr: str | None = None) -> MpiCommand:
    """The MPI command for a plan (pure); ``head_addr`` is where Hydra's proxies reach it."""
    for hp in plan.hosts:
        if hp.cuda_visible_devices is not None:
            raise UsageError("slot selection unsupported with --launcher mpirun",
                             f"host {hp.entry.name}", "MPI launchers cannot give each host its "
                             "own CUDA_VISIBLE_DEVICES", "use the default SSH launcher for "
                             "--include/--exclude of GPU slots")
    program = (*python_module(python, "launcher.mpirun.rankshim"), "--", *plan.argv)
    env = shared_env(plan, rendezvous)
    n = str(plan.world_size)
    if flavour == "hydra":
        for hp in plan.hosts:
            if hp.entry.user or hp.entry.port:
                raise UsageError("user@/port= unsupported with Hydra", hp.entry.source or
                                 hp.entry.name, "mpiexec -hosts takes plain names",
                                 "put User/Port in ~/.ssh/config instead")
        hosts = ",".join(f"{hp.entry.name}:{len(hp.ranks)}" for hp in plan.hosts)
        genv = ("-genvlist", ",".join(sorted(env))) if env else ()
        control = ("-localhost", head_addr) if head_addr else ()
        return MpiCommand((mpirun, "-launcher", "ssh", *control, "-hosts", hosts, "-n", n,
                           "-wdir", plan.cwd, *genv, *program), env)
    if flavour == "openmpi":
        lines = []
        for hp in plan.hosts:
            name = f"{hp.entry.user}@{hp.entry.name}" if hp.entry.user else hp.entry.name
            lines.append(f"{name} slots={len(hp.ranks)}")
        exports = [a for k in sorted(env) for a in ("-x", k)]
        return MpiCommand((mpirun, "--hostfile", "{hostfile}", "-np", n, "--map-by", "slot",
                           "--wdir", plan.cwd, *exports, *program), env,
                          "\n".join(lines) + "\n")
    raise UsageError("unknown MPI flavour", "--mpi-flavour", flavour, f"use one of {FLAVOURS}")


def run_command(cmd: MpiCommand, *, timeout: float | None = None, grace: float = 10.0) -> int:
    """Run it with our scrubbed environment plus the job's variables; Ctrl-C/SIGTERM reach it;
    its exit code is ours. After ``timeout`` seconds it gets SIGTERM (Hydra then stops every
    rank), SIGKILL after ``grace``, and the exit code is 124, as with the SSH launcher."""
    from launcher.plan.environment import scrub

    env = {**scrub(os.environ), **cmd.env}
    if cmd.hostfile_text is None:  # no scratch directory for a SIGKILLed head to leave behind
        return _run(list(cmd.argv), env, timeout, grace)
    with tempfile.TemporaryDirectory(prefix="dtrain-mpirun-") as tmp:
        path = os.path.join(tmp, "hostfile")
        with open(path, "w") as f:
            f.write(cmd.hostfile_text)
        return _run([path if a == "{hostfile}" else a for a in cmd.argv], env, timeout, grace)


def _run(argv: list[str], env: dict[str, str], timeout: float | None, grace: float) -> int:
    from launcher.mpirun.rankshim import die_with_parent

    # A SIGKILLed head must not leave the MPI launcher behind: SIGTERM makes it end the job.
    proc = subprocess.Popen(argv, env=env, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    forward = {s: signal.signal(s, lambda signum, _f: proc.send_signal(signum))
               for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        sys.stderr.write(f"dtrain: stopped by --timeout after {timeout:g}s\n")
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 124
    finally:
        for s, handler in forward.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code


def find_mpirun(name: str | None) -> str:
    candidates: Sequence[str] = (name,) if name else ("mpiexec", "mpirun")
    for cand in candidates:
        # The venv's bin first: that is where the `mpich` wheel puts its Hydra.
        here = os.path.join(os.path.dirname(sys.executable), cand)
        path = here if os.access(here, os.X_OK) else shutil.which(cand)
        if path:
            return path
    raise UsageError("no MPI launcher found", "--launcher mpirun",
                     f"none of {', '.join(candidates)} is installed",
                     "install MPI (e.g. `pip install mpich`) or pass --mpirun PATH")
