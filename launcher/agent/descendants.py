"""Every process a job started on this host, found and stopped, including those that left its
process groups (the agent's adapter for stray descendants).

Ranks are stopped by signalling their process groups (`launcher.agent.ranks`), but a descendant
that called ``setsid()`` (daemonising tools, ``setsid cmd``, some data loaders) has a group of
its own and escapes that signal. So the agent makes itself a *child subreaper*
(``PR_SET_CHILD_SUBREAPER``): a process orphaned anywhere under it is re-parented to the agent
instead of to init, which keeps the whole job one tree under the agent. `signal_descendants`
walks that tree (psutil, i.e. /proc) and signals every process in it, so ``setsid`` children,
double-forked daemons and orphans of exited ranks are stopped with the job; `kill_strays`
SIGKILLs them and collects the exit status of the orphans the agent inherited (it is their
parent now). The ranks themselves are left to the threads that wait for them.

Limits: a process that leaves the tree on purpose is not found: one started through a service
manager or another daemon (``systemd-run``, ``at``, ``docker run``, ``ssh`` to another host), or
one that survives a SIGKILL of the agent itself (the ranks die by their parent-death signal, but
their descendants are then re-parented to init). cgroup v2 with ``cgroup.kill`` would close
those gaps where a delegated, writable cgroup exists; this works without one.
"""

from __future__ import annotations

import ctypes
import os
import signal

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True

if TYPE_CHECKING:  # psutil is imported when a stop needs it: it costs the agent's start-up
    import psutil

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make orphans below this process re-parent to it; False where the kernel refuses."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def signal_descendants(sig: int, keep: frozenset[int] = frozenset()) -> list[psutil.Process]:
    """Send ``sig`` to every live descendant of this process except the PIDs in ``keep``;
    returns those signalled. A process that exits meanwhile is skipped."""
    import psutil

    hit: list[psutil.Process] = []
    try:
        tree = psutil.Process().children(recursive=True)
    except psutil.Error:
        return hit
    for proc in tree:
        try:
            if proc.pid in keep or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            proc.send_signal(sig)
            hit.append(proc)
        except psutil.Error:
            pass
    return hit


def descendant_pids() -> list[int] | None:
    """Every descendant of this process, read down the kernel's per-thread lists of children
    (``/proc/PID/task/TID/children``): only this process's tree is read. None where the kernel
    keeps no such lists (built without CONFIG_PROC_CHILDREN)."""
    me = os.getpid()
    if not os.path.exists(f"/proc/{me}/task/{me}/children"):
        return None
    found: list[int] = []
    frontier = [me]
    while frontier:
        pid = frontier.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # exited meanwhile
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    children = [int(child) for child in f.read().split()]
            except OSError:
                continue  # the thread or process ended meanwhile
            found += children
            frontier += children
    return found


def kill_strays(keep: frozenset[int] = frozenset(), rounds: int = 5, *,
                reaping: bool = True) -> None:
    """SIGKILL every descendant except ``keep`` (the ranks, reaped by their own threads) and
    collect the orphans among them; repeated because a process may fork while the tree is
    walked.

    ``reaping=False`` says no other thread of this process is reaping a child now (no rank is
    left): then this process's own lists of children are exact, and when they hold nothing
    but ``keep`` nothing else is read. Otherwise, and when they do, every process of the
    machine is read (psutil), because a list read while one of its children is reaped can
    skip another. At the end of every job each of a host's agents did that walk twice, and
    64 namespace hosts (one machine's process table, walked by 64 agents at once) spent most
    of the job's exit tail on it (`bench.hosts_scale`)."""
    if not reaping:
        tree = descendant_pids()
        if tree is not None and keep.issuperset(tree):
            return
    import psutil

    for _ in range(rounds):
        hit = signal_descendants(signal.SIGKILL, keep)
        if not hit:
            break
        psutil.wait_procs(hit, timeout=1.0)  # reaps those that are our children
    reap_orphans(keep)


def reap_orphans(keep: frozenset[int] = frozenset()) -> None:
    """Collect exited children that are not ranks: orphans re-parented to the agent. Only
    specific PIDs are waited for, so the ranks' exit statuses are left to their own reapers."""
    import psutil

    try:
        children = psutil.Process().children()
    except psutil.Error:
        return
    for proc in children:
        if proc.pid not in keep:
            try:
                os.waitpid(proc.pid, os.WNOHANG)
            except ChildProcessError:
                pass
