"""A real Slurm on one machine: slurmctld on the head, one slurmd per network-namespace host.

Debian's `slurmctld`, `slurmd` and `munged` (installed by `testbed/install_sysdeps.sh`) run
from a private temporary directory: a fresh munge key and socket, a generated ``slurm.conf``
naming every `NetnsCluster` host as a node (its own node name, its namespace address), and
per-node spool, log and pid files (``%n``). Clients find it through ``SLURM_CONF`` (see
`env`), so nothing under /etc is touched and several instances can coexist.

slurmctld runs in the root namespace on the bridge address under a UTS namespace whose
hostname is the controller's name (slurmctld refuses to start on a host that is not its
``SlurmctldHost``); each slurmd runs as ``ip netns exec NS unshare --uts -- sh -c 'hostname H
&& exec slurmd -D -N H'``, so the PID started is the daemon. Every PID is recorded; a crashed
session's daemons are reaped by the next instance through a state file naming its creator.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from testbed.netns import NetnsCluster, wait_no_pids
from testbed.sshd import DaemonExited, free_port, kill_pids, log_tail, stop_process, wait_for_port
from testbed.stale import (
    STATE_DIR,
    abandoned,
    process_key,
    record,
    remove_scratch,
    still_running,
)

TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "salloc", "scontrol", "scancel")
CPUS_PER_NODE = 4   # declared, not real: config_overrides lets 4 tasks share 2 cores


def slurm_available() -> tuple[bool, str]:
    """(usable, reason): root and every Slurm and munge program."""
    if os.geteuid() != 0:
        return False, "needs root (munged, slurmd in network namespaces)"
    missing = [t for t in TOOLS if not shutil.which(t) and not os.path.exists(f"/usr/sbin/{t}")]
    if missing:
        return False, f"needs {', '.join(missing)} (run `make sysdeps` as root)"
    return True, ""


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def reap_stale(state_dir: Path = STATE_DIR) -> None:
    """Kill the root-namespace daemons of instances whose creating process is gone."""
    for path, state in abandoned("slurm", ("pids",), state_dir):
        kill_pids(still_running(state["pids"]))
        remove_scratch(state.get("dir"), "dtrain-slurm-")
        path.unlink(missing_ok=True)


class SlurmCluster:
    """Slurm over the hosts of ``netns``: partition ``debug`` holds every host as a node."""

    def __init__(self, netns: NetnsCluster, *, slurmd_timeout: int = 5) -> None:
        reap_stale()
        self.netns = netns
        self.hosts = list(netns.hosts)
        self.dir = Path(tempfile.mkdtemp(prefix=f"dtrain-slurm-{netns.suffix}-"))
        os.chmod(self.dir, 0o700)  # munged refuses a socket or key in a group-writable dir
        self.controller = f"dtctl{netns.suffix}"
        self.conf = self.dir / "slurm.conf"
        self._daemons: dict[str, subprocess.Popen] = {}
        self._state = STATE_DIR / f"slurm-{netns.suffix}.json"
        self._closed = False
        atexit.register(self.close)
        try:
            self._start_munge()
            self._start_controller(slurmd_timeout)
            for host in self.hosts:
                self.start_slurmd(host)
            self.wait_idle(self.hosts, timeout=30)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ set-up
    def _start_munge(self) -> None:
        key = self.dir / "munge.key"
        subprocess.run([_tool("mungekey"), "--create", f"--keyfile={key}"], check=True,
                       capture_output=True)
        os.chmod(key, 0o400)
        self.munge_socket = self.dir / "munge.socket"
        self._start("munged", [], [
            _tool("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
            f"--key-file={key}", f"--pid-file={self.dir / 'munged.pid'}",
            f"--log-file={self.dir / 'munged.log'}", f"--seed-file={self.dir / 'munged.seed'}"])
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if time.monotonic() > deadline or self._daemons["munged"].poll() is not None:
                raise RuntimeError(f"munged did not start: {self._log('munged')}")
            time.sleep(0.05)

    def _start_controller(self, slurmd_timeout: int, tries: int = 5) -> None:
        """Start slurmctld on a free port of the bridge address, and wait until it listens.
        The port is free when picked but not reserved: a parallel test's connection from the
        same address can take it before slurmctld binds (CI, 2026-11-30: "Address already in
        use"), so a controller that exits on that is started again on another port."""
        for _ in range(tries):
            self.port = free_port(self.netns.head_address)
            self.conf.write_text(self._config(slurmd_timeout))
            self._start("slurmctld", [], ["unshare", "--uts", "--", "sh", "-c",
                                          f"hostname {self.controller} && exec "
                                          f"{_tool('slurmctld')} -D -i -f {self.conf}"])
            try:
                wait_for_port(self.netns.head_address, self.port, self._daemons["slurmctld"],
                              *self._logs("slurmctld"), name="slurmctld", timeout=30)
                return
            except DaemonExited as exited:
                if "Address already in use" not in str(exited):
                    raise
            for stale in self._logs("slurmctld"):
                stale.unlink(missing_ok=True)
        raise RuntimeError(f"slurmctld found no free port in {tries} tries")

    def _config(self, slurmd_timeout: int) -> str:
        d = self.dir
        nodes = "\n".join(f"NodeName={h} NodeAddr={self.netns.address(h)} "
                          f"CPUs={CPUS_PER_NODE} State=UNKNOWN" for h in self.hosts)
        return f"""\
ClusterName=dt{self.netns.suffix}
SlurmctldHost={self.controller}({self.netns.head_address})
SlurmctldPort={self.port}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdTimeout={slurmd_timeout}
MessageTimeout=5
KillWait=2
InactiveLimit=0
SlurmdParameters=config_overrides
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    def _start(self, name: str, prefix: list[str], argv: list[str]) -> None:
        with open(self.dir / f"{name}.out", "ab") as out:
            self._daemons[name] = subprocess.Popen(
                [*prefix, *argv], stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)
        self._record()

    def _record(self) -> None:
        keys = [process_key(p.pid) for p in self._daemons.values() if p.poll() is None]
        record(self._state, pids=[key for key in keys if key is not None], dir=str(self.dir))

    def _logs(self, name: str) -> tuple[Path, Path]:
        """The daemon's output (until it opens its log file) and its log file."""
        return self.dir / f"{name}.out", self.dir / f"{name}.log"

    def _log(self, name: str) -> str:
        return log_tail(*self._logs(name))

    # ------------------------------------------------------------ queries
    def env(self) -> dict[str, str]:
        """The environment a Slurm client command needs: os.environ plus SLURM_CONF."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True, timeout: float = 30
            ) -> subprocess.CompletedProcess:
        """Run a Slurm client command (`scontrol ...`) against this cluster."""
        return subprocess.run(list(argv), env=self.env(), capture_output=True, text=True,
                              check=check, timeout=timeout)

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N %t", check=False).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def wait_idle(self, hosts: list[str], timeout: float) -> None:
        """Wait until every host is an idle node (a restarted slurmd has registered). When
        they are not, the error carries the controller's log too: slurmd only says it could
        not reach it (seen once in a full run, 2026-11-29, the controller's log gone with the
        session), and a controller that exited is reported at once."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.node_states()
            if all(states.get(h) == "idle" for h in hosts):
                return
            controller = self._daemons.get("slurmctld")
            ended = controller is not None and controller.poll() is not None
            if ended or time.monotonic() > deadline:
                logs = "\n".join([f"slurmctld (exit {controller.poll() if controller else None}):",
                                  self._log("slurmctld"),
                                  *(self._log(f"slurmd-{h}") for h in hosts
                                    if states.get(h) != "idle")])
                raise RuntimeError(f"Slurm nodes not idle: {states}\n{logs}")
            time.sleep(0.2)

    def slurmd_pid(self, host: str) -> int | None:
        proc = self._daemons.get(f"slurmd-{host}")
        return proc.pid if proc is not None and proc.poll() is None else None

    def job_pids(self, host: str) -> set[int]:
        """Processes in the host's namespace other than its slurmd and sshd (a job's)."""
        return self.netns.job_pids(host) - {self.slurmd_pid(host)}

    def wait_no_job_pids(self, timeout: float) -> dict[str, set[int]]:
        """Wait until no host runs anything of a job; returns the leftovers ({} when clean)."""
        return wait_no_pids(self.hosts, self.job_pids, timeout)

    # ------------------------------------------------------------ faults
    def start_slurmd(self, host: str) -> None:
        """(Re)start the host's slurmd under its own node name and hostname."""
        (self.dir / f"spool-{host}").mkdir(exist_ok=True)
        script = f"hostname {host} && exec {_tool('slurmd')} -D -N {host} -f {self.conf}"
        # nsenter, not `ip netns exec`: that mounts a fresh /sys without the cgroup mounts
        # slurmd's cgroup plugin insists on at start-up.
        netns = f"--net=/run/netns/{self.netns.namespace(host)}"
        self._start(f"slurmd-{host}", ["nsenter", netns],
                    ["unshare", "--uts", "--", "sh", "-c", script])

    def kill_slurmd(self, host: str) -> None:
        """SIGKILL the host's slurmd (its job steps' slurmstepd live on, as on a real node)."""
        proc = self._daemons.pop(f"slurmd-{host}", None)
        if proc is not None:
            proc.kill()
            proc.wait()
        self._record()

    # ------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop every daemon we started (slurmd first); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for name in sorted(self._daemons, key=lambda n: not n.startswith("slurmd")):
            stop_process(self._daemons[name], grace=2.0)
        for host in self.hosts:  # slurmstepd and what it ran, by namespace
            kill_pids(self.job_pids(host))
        self._state.unlink(missing_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        atexit.unregister(self.close)
