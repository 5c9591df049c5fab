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


# The walk and the sweep run in a process of their own: they act on every descendant of the
# process that calls them, which in pytest would include other tests' processes.
WALK = """
import json, os, subprocess, sys, threading, time
from launcher.agent import descendants
child = subprocess.Popen(['sleep', '60'])
# A grandchild in a session of its own, from a thread (its child is listed under that thread).
holder = []
thread = threading.Thread(target=lambda: holder.append(subprocess.Popen(
    ['setsid', 'sh', '-c', 'sleep 60 & echo $!; wait'], stdout=subprocess.PIPE, text=True)))
thread.start(); thread.join()
grandchild = int(holder[0].stdout.readline())
walked = sorted(descendants.descendant_pids() or [])
expected = sorted([child.pid, holder[0].pid, grandchild])
if sys.argv[1] == 'keep-all':
    descendants.kill_strays(keep=frozenset(expected), reaping=False)
    time.sleep(0.2)
    survivors = [p for p in expected if os.path.exists(f'/proc/{p}')]
else:
    descendants.kill_strays(keep=frozenset([child.pid]), reaping=False)
    holder[0].wait(timeout=10)
    time.sleep(0.2)
    survivors = [p for p in expected if os.path.exists(f'/proc/{p}')
                 and open(f'/proc/{p}/stat').read().rpartition(')')[2].split()[0] != 'Z']
print(json.dumps({"walked": walked, "expected": expected, "survivors": survivors,
                  "child": [child.pid]}))
for p in expected:
    try:
        os.kill(p, 9)
    except ProcessLookupError:
        pass
"""


def _walk(mode: str) -> dict[str, list[int]]:
    import json
    import subprocess

    out = subprocess.run([PYTHON, "-c", WALK, mode], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    result: dict[str, list[int]] = json.loads(out.stdout)
    return result


def test_the_walk_down_the_kernels_lists_of_children_finds_children_of_threads_and_grandchildren():
    result = _walk("keep-all")
    assert result["walked"] == result["expected"]


def test_with_only_kept_processes_below_it_the_sweep_stops_nothing():
    result = _walk("keep-all")
    assert result["survivors"] == result["expected"]


def test_the_sweep_kills_a_grandchild_in_its_own_session_and_keeps_what_it_was_told_to():
    result = _walk("kill")
    assert result["survivors"] == result["child"]
