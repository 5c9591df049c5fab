"""What a job leaves on its host, and the next agent there removing what a dead one left
(adapter around the pure naming and judging rules).

An agent that leaves normally removes its private folder (`launcher.agent.progress`) and the
/dev/shm segments of its job's MPICH ranks (`remove_mpich_segments`). One that is SIGKILLed
(the OOM killer, a lost node) removes nothing, and its ranks die by their parent-death signal.
So each agent names its folder ``dtrain-<job>-agent<pid>_<start>_<pidns>-XXXXXXXX``: its PID,
its start time (clock ticks after boot, /proc/<pid>/stat) and its PID namespace, and the next
agent on the host, before it makes its own, removes (`sweep`) each folder that is provably a
dead agent's:

* a directory (lstat: a link is never followed, and removal works below an open descriptor of
  the folder, so nothing is followed out of it) owned by this user,
* named as above, from this PID namespace (a PID of another namespace names nobody here),
* and no process with that PID and start time exists (a reused PID has another start time).

A job's MPICH segments (``mpich_shm_<hash of job>_*``: `launcher.pmi.actions`) go when every
folder of that job on the host was removed so. Everything else is left: another user's
folders, a live agent's, another namespace's, names in another form (older dtrain versions).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Callable

from records import Record

SHM = "/dev/shm"
#: Compiled at its first use (re's cache), not during the agent's start-up.
_FOLDER = r"dtrain-(?P<job>.+)-agent(?P<pid>\d+)_(?P<start>\d+)_(?P<ns>\d+)-\w+\Z"


class AgentMark(Record, frozen=True):
    """Which agent made a folder: enough to tell, later, that it is gone."""

    #: Its process id.
    pid: int
    #: When it started: clock ticks after boot (field 22 of /proc/<pid>/stat).
    start: int
    #: Its PID namespace (the inode of /proc/<pid>/ns/pid).
    pidns: int

    def tag(self) -> str:
        return f"agent{self.pid}_{self.start}_{self.pidns}"


def folder_prefix(job_id: str, mark: AgentMark | None) -> str:
    """The prefix of an agent's private folder (``mkdtemp`` adds the random end)."""
    return f"dtrain-{job_id}-{mark.tag()}-" if mark is not None else f"dtrain-{job_id}-"


def parse(name: str) -> tuple[str, AgentMark] | None:
    """(job id, the agent's mark) of a folder named by `folder_prefix`, else None."""
    m = re.match(_FOLDER, name) if name.startswith("dtrain-") and "-agent" in name else None
    if m is None:
        return None
    return m["job"], AgentMark(int(m["pid"]), int(m["start"]), int(m["ns"]))


def is_dead(mark: AgentMark, ours: AgentMark, start_of: Callable[[int], int | None]) -> bool:
    """True only when the agent that made ``mark`` is provably gone. ``start_of(pid)`` is that
    process's start time, None when no such process exists; it raises OSError when it cannot
    tell (then the agent may be alive)."""
    if mark.pidns != ours.pidns:
        return False
    try:
        return start_of(mark.pid) != mark.start
    except OSError:
        return False


def own_mark() -> AgentMark | None:
    """This process's mark; None where /proc cannot tell (then nothing is judged dead)."""
    try:
        start = start_of(os.getpid())
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return AgentMark(os.getpid(), start, pidns) if start is not None else None


def start_of(pid: int) -> int | None:
    """The start time of process ``pid``; None when there is none (OSError: cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except FileNotFoundError:
        return None
    return int(fields[19])  # field 22: starttime (fields from the 3rd on after the name)


def sweep(base: str, ours: AgentMark | None) -> list[str]:
    """Remove the folders in ``base`` of provably dead agents, and the MPICH segments of jobs
    with no other folder here; returns the names of the folders removed. Never raises: a
    failure leaves things as they were, for a later agent."""
    if ours is None:
        return []
    try:
        folder = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return []
    removed: list[str] = []
    try:
        jobs: dict[str, list[tuple[str, bool]]] = {}
        for name in os.listdir(folder):
            parsed = parse(name)
            if parsed is not None:
                job, mark = parsed
                dead = _own_directory(folder, name) and is_dead(mark, ours, start_of)
                jobs.setdefault(job, []).append((name, dead))
        for job, found in jobs.items():
            gone = [name for name, dead in found if dead and _remove_tree(folder, name)]
            removed += gone
            if len(gone) == len(found):  # no agent of the job is left on this host
                remove_mpich_segments(job)
    except OSError:
        pass
    finally:
        os.close(folder)
    return removed


def remove_mpich_segments(kvsname: str) -> None:
    """Delete the /dev/shm segments of the job's MPICH ranks (killed ranks leave them): files
    of ours only, never through a link."""
    from launcher.pmi.actions import shm_segment_prefixes  # not at the agent's start-up

    prefixes = shm_segment_prefixes(kvsname)
    try:
        shm = os.open(SHM, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        for name in os.listdir(shm):
            if name.startswith(prefixes):
                _unlink_own_file(shm, name)
    finally:
        os.close(shm)


def _own_directory(folder: int, name: str) -> bool:
    try:
        st = os.lstat(name, dir_fd=folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def _remove_tree(folder: int, name: str) -> bool:
    """shutil.rmtree below ``folder``'s descriptor: it opens each level without following a
    link and checks it is still the directory it listed."""
    try:
        shutil.rmtree(name, dir_fd=folder)
    except OSError:
        return False
    return True


def _unlink_own_file(folder: int, name: str) -> None:
    try:
        st = os.lstat(name, dir_fd=folder)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            os.unlink(name, dir_fd=folder)
    except OSError:
        pass
