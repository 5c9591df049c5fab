"""What a test session left behind: state files that let the next session clean up after it.

A session that is SIGKILLed (or whose machine is snapshotted and restored) cannot run its
``atexit`` clean-up, so each testbed component records what it created in a JSON file under
``STATE_DIR`` before creating it. Every kind of component owns its own file prefix
(``netns-``, ``slurm-``) and reads only those files: one kind's reaper must never trip over
another kind's state.

Processes are recorded as (pid, start time) pairs, never as bare pids: after a restore or a
long time the pid of a dead creator or daemon may belong to an unrelated process, which must
neither be taken for the creator (the state would never be reaped) nor be killed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from testbed.procfs import stat_fields

STATE_DIR = Path("/run/dtrain-test-netns")

ProcessKey = tuple[int, int]  # pid, start time in clock ticks since boot (/proc/PID/stat)


def process_key(pid: int) -> ProcessKey | None:
    """The pid with its start time, or None when no such process runs."""
    fields = stat_fields(pid)
    return None if fields is None else (pid, int(fields[19]))


def running(key: ProcessKey) -> bool:
    """Whether the very process ``key`` names is still running (not a reuse of its pid)."""
    return process_key(key[0]) == key


def record(path: Path, **fields: Any) -> None:
    """Write ``fields`` with this process as the creator, atomically (a reaper may read it)."""
    creator = process_key(os.getpid())
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"creator": creator, **fields}))
    tmp.replace(path)


def abandoned(prefix: str, required: tuple[str, ...],
              state_dir: Path = STATE_DIR) -> Iterator[tuple[Path, dict[str, Any]]]:
    """The ``prefix``-files whose creator is gone, with their state.

    Files that cannot be read or lack a ``required`` field are skipped, not fatal: a
    half-written or older file must not stop the suite; it is reported by name.
    """
    if not state_dir.is_dir():
        return
    for path in sorted(state_dir.glob(f"{prefix}-*.json")):
        try:
            state = json.loads(path.read_text())
            creator = tuple(state["creator"])
            missing = [name for name in required if name not in state]
        except (OSError, ValueError, TypeError, KeyError):
            print(f"testbed: skipping unreadable state file {path}")
            continue
        if missing or len(creator) != 2:
            print(f"testbed: skipping state file {path}: it lacks {missing or ['creator']}")
            continue
        if not running((int(creator[0]), int(creator[1]))):
            yield path, state


def still_running(keys: list[list[int]]) -> set[int]:
    """The pids of the recorded processes that are still the processes recorded."""
    return {pid for pid, start in keys if running((pid, start))}


def remove_scratch(path: str | None, prefix: str) -> None:
    """Delete a dead session's temporary directory, if it is one of ours by place and name."""
    if path is None:
        return
    scratch = Path(path)
    if scratch.parent == Path(tempfile.gettempdir()) and scratch.name.startswith(prefix):
        shutil.rmtree(scratch, ignore_errors=True)
