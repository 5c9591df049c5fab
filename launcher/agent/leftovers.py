"""What the ranks of a job leave on their host, removed by the agent (adapter)."""

from __future__ import annotations

import os
import stat

from launcher.pmi.actions import shm_segment_prefixes

SHM = "/dev/shm"


def remove_mpich_segments(kvsname: str) -> None:
    """Delete the /dev/shm segments of the job's MPICH ranks (killed ranks leave them): files
    of ours only, never through a link."""
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


def _unlink_own_file(folder: int, name: str) -> None:
    try:
        st = os.lstat(name, dir_fd=folder)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            os.unlink(name, dir_fd=folder)
    except OSError:
        pass
