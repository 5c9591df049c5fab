"""A rank's descendants that left its process group (setsid, daemons) are stopped with the job."""

from __future__ import annotations

from pathlib import Path

from tests.support import PYTHON, REPO, alive, kill_recorded, run_dtrain, wait_gone

ESCAPER = str(REPO / "tests" / "support" / "workers" / "escaper.py")


def _recorded(pid_dir: Path) -> dict[int, list[int]]:
    return {int(f.stem): [int(p) for p in f.read_text().split()] for f in pid_dir.glob("*.pid")}


def test_setsid_children_and_daemons_of_a_failing_job_do_not_outlive_it(tmp_path):
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--grace", "2", "--",
                      PYTHON, ESCAPER, "0", "7"], env={"PROBE_PID_DIR": str(tmp_path)})
    pids = [p for ps in _recorded(tmp_path).values() for p in ps]
    try:
        assert res.returncode == 7, res.stderr
        assert len(pids) == 6
        assert not wait_gone(pids, 10)
    finally:
        kill_recorded(pids)


def test_a_daemon_left_by_a_job_that_succeeded_is_stopped_at_its_end(tmp_path):
    code = ("import os, subprocess; "
            "p = subprocess.run(['setsid', 'sh', '-c', 'sleep 1000 >/dev/null 2>&1 & echo $!'], "
            "capture_output=True, text=True); "
            "open(os.environ['PROBE_PID_DIR'] + '/0.pid', 'w').write(p.stdout)")
    res = run_dtrain(["launch", "--", PYTHON, "-c", code], env={"PROBE_PID_DIR": str(tmp_path)})
    pids = [p for ps in _recorded(tmp_path).values() for p in ps]
    try:
        assert res.returncode == 0, res.stderr
        assert len(pids) == 1
        assert not wait_gone(pids, 10), [p for p in pids if alive(p)]
    finally:
        kill_recorded(pids)
