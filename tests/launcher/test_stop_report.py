"""Who stopped each rank, as `dtrain launch`'s exit report says it: real agents on this host.

A rank's status names the signal that ended it and whether dtrain sent it (and when, after
which first signal), or the code it exited with after dtrain's signal; a SIGTERM that reaches
the ranks and the head alike (scancel, preemption, a pod's end) lets the ranks that still save
their checkpoint finish within the grace instead of being killed at once.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.support import (
    PYTHON,
    REPO,
    kill_recorded,
    report_table,
    start_dtrain,
    wait_for_lines,
    wait_gone,
)

PROBE = str(REPO / "tests" / "support" / "workers" / "probe.py")


def _launch(tmp_path: Path, grace: str, *program: str):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    head = start_dtrain(["launch", "--nproc-per-node", "2", "--grace", grace, "--", PYTHON,
                         PROBE, *program], env={"PROBE_PID_DIR": str(pid_dir)})
    pids = [int(wait_for_lines(pid_dir / f"{rank}.pid", 1)[0]) for rank in (0, 1)]
    return head, pids


def test_a_sigterm_to_ranks_and_head_alike_lets_every_rank_save_and_says_who_stopped_whom(
        tmp_path):
    head, pids = _launch(tmp_path, "20", "save", "0.2", "3")
    try:
        for pid in pids:  # Slurm's scancel: the ranks get SIGTERM from Slurm ...
            os.kill(pid, signal.SIGTERM)
        time.sleep(1.0)  # rank 0 saved and exited 143, so dtrain is stopping rank 1 by now
        head.send_signal(signal.SIGTERM)  # ... and the head gets its own
        out, err = head.communicate(timeout=60)
        assert head.returncode == 143, err
        assert "rank 1 saved" in out  # not killed while it saved
        assert "failure rank 0@localhost: exited with code 143 (128 + SIGTERM, not sent " \
               "by dtrain)" in err
        assert report_table(err) == {0: "exit 143", 1: "exit 143 after dtrain's SIGTERM"}
        assert not wait_gone(pids, 10)
    finally:
        head.kill()
        kill_recorded(pids)


def test_ranks_still_running_at_the_end_of_the_grace_are_reported_killed_by_dtrain(tmp_path):
    head, pids = _launch(tmp_path, "1", "ignore-term")
    try:
        head.send_signal(signal.SIGTERM)
        _, err = head.communicate(timeout=60)
        assert head.returncode == 143, err
        table = report_table(err)
        assert sorted(table) == [0, 1]
        for status in table.values():
            assert status.startswith("killed by SIGKILL from dtrain, 1.") and status.endswith(
                "s after its SIGTERM"), status
        assert not wait_gone(pids, 10)
    finally:
        head.kill()
        kill_recorded(pids)
