"""--launcher slurm: each host's agent is one `srun` job step; its pipes are the stream.

    srun --jobid=J --nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist=HOST --overlap
         --unbuffered --mpi=none --quiet -- <python> -E -P -u -m launcher.agent

One step per host rather than one step of N tasks: each agent's stream is then srun's own
stdin/stdout, an inherited pipe that Slurm carries over its authenticated (munge) I/O
connection, so there is no listening socket and no secret to hand out; a host's failure is
that host's step ending, named by host; and the streams are the local transport's pipes, so
everything after start-up is the SSH launcher's code path. The steps start in parallel (one
`srun` each); bench/slurm.py measures the cost against a bare `srun` of the ranks.

`--overlap` lets the steps share the node with the batch step; `--unbuffered` stops
slurmstepd from holding frames back until a newline; `--mpi=none` keeps Slurm's PMI out of
the agent (dtrain serves PMI itself). srun gets the head's environment less the SLURM_*
variables, which srun would read as options (SLURM_NTASKS_PER_NODE=4 would contradict
--ntasks=1): only the job id is passed, as --jobid.

A step ends when Slurm cancels the job (`scancel`), when its node fails, or when the head
closes srun's stdin (the agent sees EOF and stops its ranks). `kill` (the last resort, the
local transport's) SIGKILLs srun: Slurm then terminates the step, even an agent that hangs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence

from launcher.errors import ConnectError, UsageError
from launcher.hosts.selection import HostSlots
from launcher.slurm.allocation import JOB_ID
from launcher.transport.local import LocalAgentStream, agent_command
from launcher.transport.options import SSHOptions
from launcher.transport.stream import AgentStream
from launcher.transport.table import Opened


class SrunNode:
    """The `connection` of a step: the node's address as Slurm knows it (NodeAddr)."""

    def __init__(self, host: str, started: float) -> None:
        self.address = host   # the node name until `scontrol` tells its NodeAddr
        self._started = started
        self.latency_ms = 0.0

    def peer_address(self) -> str:
        return self.address

    def first_byte(self) -> None:
        if not self.latency_ms:
            self.latency_ms = (time.monotonic() - self._started) * 1000

    def close(self) -> None:
        """Nothing to close: the step ends with its srun."""


class SrunAgentStream(LocalAgentStream):
    """AgentStream over the pipes of one `srun` step running the agent on ``host``."""

    is_local = False

    def __init__(self, host: str, argv: Sequence[str], env: Mapping[str, str]) -> None:
        self.node = SrunNode(host, time.monotonic())
        self.connection = self.node
        super().__init__(host, command=argv, env=env)

    def _arrived(self, data: bytes) -> None:
        self.node.first_byte()


def srun_command(host: str, job_id: str, python: str, srun: str = "srun") -> list[str]:
    """The step for one host; `host` is a validated node name, passed as one argv item."""
    return [srun, f"--jobid={job_id}", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1",
            f"--nodelist={host}", "--overlap", "--unbuffered", "--mpi=none", "--quiet",
            "--", *agent_command(python)]


def srun_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The head's environment for srun, without the SLURM_* variables srun reads as options."""
    keep = {"SLURM_CONF"}  # where the cluster's configuration is, not an option
    return {k: v for k, v in environ.items() if not k.startswith("SLURM_") or k in keep}


def start_agents(selected: Sequence[HostSlots], *, python: str, ssh: SSHOptions | None = None,
                 environ: Mapping[str, str] = os.environ,
                 opened: Opened | None = None) -> list[AgentStream | ConnectError]:
    """One srun step per host, all started before any is waited on (``ssh`` is not used:
    Slurm carries the streams; the table's dispatch entries all take it). ``opened`` hears
    them once the nodes' addresses are known (rank 0's probe needs host 1's)."""
    job_id = environ.get(JOB_ID)
    srun = shutil.which("srun", path=environ.get("PATH"))
    if not job_id or srun is None:
        why = "SLURM_JOB_ID is not set" if not job_id else "no `srun` on PATH"
        raise UsageError("--launcher slurm needs a Slurm allocation", "--launcher slurm", why,
                         "run dtrain inside `salloc` or an `sbatch` script")
    env = srun_environment(environ)
    results: list[AgentStream | ConnectError] = []
    for host in selected:
        name = host.entry.name
        try:
            results.append(SrunAgentStream(name, srun_command(name, job_id, python, srun), env))
        except OSError as exc:
            results.append(ConnectError("cannot start srun", f"host {name}", str(exc),
                                        "check that Slurm's srun works here"))
    # Asked while the steps start: the addresses are needed only once the agents answer.
    addresses = node_addresses([h.entry.name for h in selected], env)
    for stream in results:
        if isinstance(stream, SrunAgentStream):
            stream.node.address = addresses.get(stream.host, stream.host)
    for index, stream in enumerate(results):
        if opened is not None and isinstance(stream, SrunAgentStream):
            opened(index, stream)
    return results


def node_addresses(names: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """NodeAddr of each node (`scontrol show node`): where rank 0 is reached from the others.
    Empty when scontrol cannot say; the node names are then resolved as host names."""
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol is None:
        return {}
    try:
        out = subprocess.run([scontrol, "--oneliner", "show", "node", ",".join(names)],
                             env=dict(env), capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for line in out.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("NodeName") and fields.get("NodeAddr"):
            found[fields["NodeName"]] = fields["NodeAddr"]
    return found


def slurm_ended_job(environ: Mapping[str, str] = os.environ, wait: float = 5.0) -> str | None:
    """Why Slurm itself ended the job dtrain runs in (scancel, time limit, node failure), as
    one message; None while the job is still running or when scontrol cannot tell. A job
    Slurm is ending reads COMPLETING until its nodes are clean; up to ``wait`` seconds are
    given to learn the final state (a job whose rank failed on its own is RUNNING: no wait)."""
    job_id = environ.get(JOB_ID)
    deadline = time.monotonic() + wait
    while job_id:
        fields = _job_fields(job_id, environ)
        state = fields.get("JobState", "")
        if state != "COMPLETING" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    else:
        return None
    if state in ("", "RUNNING", "COMPLETED", "PENDING"):
        return None
    return (f"Slurm ended the job [Slurm job {job_id}: {state}, reason {fields.get('Reason')}]: "
            "Slurm stopped the job's steps (scancel, a time limit or a failed node), and the "
            f"exit code is what that did to the ranks. See `scontrol show job {job_id}` or "
            f"`sacct -j {job_id}`")


def _job_fields(job_id: str, environ: Mapping[str, str]) -> dict[str, str]:
    """`scontrol show job` as a dict; empty when scontrol is missing or does not answer."""
    scontrol = shutil.which("scontrol", path=environ.get("PATH"))
    if scontrol is None:
        return {}
    try:
        out = subprocess.run([scontrol, "--oneliner", "show", "job", job_id],
                             env=srun_environment(environ), capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(f.split("=", 1) for f in out.split() if "=" in f)
