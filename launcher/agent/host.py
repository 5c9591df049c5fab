"""The agent's hands on its host (adapter): what it does to processes and files of the host.

    start_rank          start one rank process (`launcher.agent.ranks.start_rank`)
    stat                read a rank's state and CPU time in /proc (the progress records' view)
    records_folder      make the folder of a round's progress records, after sweeping away
                        what dead agents of the host left (`launcher.agent.leftovers`)
    kill_strays, signal_descendants
                        the job's processes that left the ranks' groups
                        (`launcher.agent.descendants`)

`Agent` and `ProgressReporter` take one `Host` and use nothing else of the host for these,
so everything above the host (frames, PMI, relays, progress records) is one code path
whoever plays the host: a real agent uses this class as it is; the simulated cluster
(`testbed.simcluster`) passes a subclass whose ranks are PMI-1 conversations inside its own
process, with no process of their own to read or sweep.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence

from launcher.agent import descendants, leftovers, ranks

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    import psutil

SHM = "/dev/shm"
_TICKS = os.sysconf("SC_CLK_TCK")


class Host:
    """This machine, as an agent process sees it."""

    def start_rank(self, rank: int, argv: Sequence[str], env: Mapping[str, str], cwd: str,
                   pass_fds: Sequence[int], stdin_pipe: bool = False) -> ranks.RankProcess:
        """One rank, its output not read yet; OSError when it cannot start."""
        return ranks.start_rank(rank, argv, env, cwd, pass_fds, stdin_pipe=stdin_pipe)

    def stat(self, pid: int | None) -> tuple[str, float | None, bool]:
        """``stopped`` for a process in state T (SIGSTOP) or t (traced), else running; the
        CPU seconds it has used (user + system, all threads), None when unknown; and whether
        it is runnable or in uninterruptible I/O now (R, D: on a CPU, waiting for one, or for
        the disk, as ranks importing on a loaded host are, using little CPU)."""
        if not pid:
            return "running", None, False
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            return "running", None, False
        fields = stat.rpartition(")")[2].split()  # fields from the 3rd on: state, ppid, ...
        cpu = (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (14th and 15th)
        return ("stopped" if fields[0] in ("T", "t") else "running"), cpu, fields[0] in ("R", "D")

    def records_folder(self, job_id: str) -> str:
        """A new private folder (0700) for a round's progress records: in /dev/shm (memory),
        the temp dir where that is missing; its name marks this agent, and what dead agents
        left there is removed first."""
        base = SHM if os.path.isdir(SHM) and os.access(SHM, os.W_OK) else None
        mark = leftovers.own_mark()
        leftovers.sweep(base or tempfile.gettempdir(), mark)
        return tempfile.mkdtemp(prefix=leftovers.folder_prefix(job_id, mark), dir=base)

    def kill_strays(self, keep: frozenset[int] = frozenset(), *, reaping: bool = True) -> None:
        """SIGKILL the job's processes but ``keep``; ``reaping``: a rank may be reaped
        meanwhile (`descendants.kill_strays`)."""
        descendants.kill_strays(keep=keep, reaping=reaping)

    def signal_descendants(self, sig: int, keep: frozenset[int] = frozenset()
                           ) -> list[psutil.Process]:
        return descendants.signal_descendants(sig, keep=keep)
