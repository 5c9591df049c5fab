"""`python -m launcher.mpirun.rankshim -- PROGRAM ARGS`: one rank under `--launcher mpirun`.

MPI launchers start the program with their own variables only, so this shim, started by them
in place of the program, gives the rank what dtrain's own agents give it:

* the worker contract (RANK, LOCAL_RANK, ... from the MPI launcher's variables:
  `workerenv.from_mpi_launcher`) and OMP_NUM_THREADS=1 unless set;
* GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME set to this host's interface that routes to
  MASTER_ADDR, unless the user set them (the agent's rule, `launcher.agent.main`);
* fail-fast: the program runs as the shim's child (with a parent-death signal, so it never
  outlives the shim) and when it fails (non-zero exit, or killed by a signal the shim did not
  forward) the shim sends ``cmd=abort`` on the PMI-1 socket Hydra gave the rank (PMI_FD), so
  Hydra stops every rank on every host and exits with the rank's code. Hydra itself only ends
  a job early when an MPI rank breaks its PMI connection; a plain non-zero exit of a rank that
  never called MPI_Init would leave the others running to the timeout. The shim keeps its
  copy of PMI_FD open, so an MPI program's exit before MPI_Finalize reaches Hydra as this
  abort too, with the program's own exit code.

Without PMI_FD (Open MPI's mpirun, which itself ends the job when a rank exits non-zero) the
shim only passes the exit code on. The cost is one small Python process per rank.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, MutableMapping

import workerenv
from launcher import netroute

SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1


def rank_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The program's environment: the contract, OMP_NUM_THREADS and the socket interfaces."""
    env = dict(environ)
    env.update(workerenv.from_mpi_launcher(env))
    env.setdefault(workerenv.OMP_NUM_THREADS, "1")
    add_socket_ifnames(env)
    return env


def add_socket_ifnames(env: MutableMapping[str, str]) -> None:
    """Gloo and NCCL guess an interface from the host name or take the first one, which on a
    multi-homed host is often a bridge that does not reach rank 0; name the routed one."""
    master = env.get(workerenv.MASTER_ADDR)
    if not master or all(name in env for name in SOCKET_IFNAME_VARS):
        return
    interface = netroute.interface_for(master)
    if interface:
        for name in SOCKET_IFNAME_VARS:
            env.setdefault(name, interface)


def abort_job(pmi_fd: int, code: int, why: str) -> bool:
    """Ask the MPI launcher to end the job with ``code`` (PMI-1 ``abort``); False when the
    socket is unusable. The message avoids spaces: old PMI clients' parsers split on them."""
    line = f"cmd=abort exitcode={code} message={why.replace(' ', '_')}\n".encode()
    try:
        with socket.socket(fileno=os.dup(pmi_fd)) as s:
            s.sendall(line)
    except OSError:
        return False
    return True


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Between fork and exec: the kernel sends ``sig`` to the child when its parent dies."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, sig)


def run(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m launcher.mpirun.rankshim -- PROGRAM [ARGS...]")
    try:
        env = rank_environment(os.environ)
    except workerenv.ContractError as exc:
        raise SystemExit(str(exc)) from None
    pmi_fd = int(env["PMI_FD"]) if env.get("PMI_FD", "").isdigit() else None
    try:
        child = subprocess.Popen(argv, env=env, close_fds=False, preexec_fn=die_with_parent)
    except OSError as exc:
        print(f"dtrain: rank {env[workerenv.RANK]} did not start [{argv[0]}]: {exc}",
              file=sys.stderr, flush=True)
        child_code, how = 127, "did_not_start"
    else:
        forwarded: list[int] = []

        def forward(signum: int, _frame: object) -> None:
            forwarded.append(signum)
            child.send_signal(signum)

        for sig in _FORWARDED:
            signal.signal(sig, forward)
        status = child.wait()
        if status < 0 and -status in forwarded:
            return 128 - status  # stopped from outside: the launcher is ending the job
        child_code = 128 - status if status < 0 else status
        how = f"killed_by_signal_{-status}" if status < 0 else f"exited_with_code_{status}"
    if child_code != 0 and pmi_fd is not None:
        abort_job(pmi_fd, child_code, f"rank_{env[workerenv.RANK]}_{how}")
    return child_code


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
