"""Output through `dtrain launch` with real ranks: long lines, floods, a stalled reader, logs.

Heartbeats run every second here (a host is lost after 3 s of silence), so a regression to
output work that starves the head's loop, or to a stalled stdout that stops heartbeats, fails
in seconds instead of passing slowly.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from bench.workers import flood
from tests.support import (
    PYTHON,
    REPO,
    dtrain_cmd,
    dtrain_env,
    kill_recorded,
    run_dtrain,
    wait_gone,
)

FLOOD = flood.__file__
FAST_BEATS = ["--heartbeat-interval", "1"]


def check_flood(stdout: bytes, ranks: int, lines: int, long: int, *, prefixed: bool) -> None:
    """Every rank's lines arrived whole, once each and in order (`bench/workers/flood.py`)."""
    problem = flood.problems(stdout, ranks, lines, long, prefixed=prefixed)
    assert problem is None, problem


def _launch(args: list[str], **kw) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(dtrain_cmd(["launch", *FAST_BEATS, *args]), capture_output=True,
                          env=dtrain_env(), cwd=REPO, **kw)


def test_a_64_kib_line_arrives_whole_and_the_job_exits_0():
    code = "import sys; sys.stdout.write('y' * 65536 + '\\n'); sys.stderr.write('e' * 65536)"
    res = _launch(["--nproc-per-node", "2", "--", PYTHON, "-c", code], timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(res.stdout.splitlines()) == [b"[0@localhost] " + b"y" * 65536,
                                               b"[1@localhost] " + b"y" * 65536]
    assert res.stderr.count(b"e" * 65536 + b"\n") == 2


@pytest.mark.parametrize("mode", ["prefixed", "--no-prefix", "--raw"])
def test_four_ranks_flooding_200000_lines_and_a_200_kb_line_lose_nothing(mode):
    flags = [] if mode == "prefixed" else [mode]
    res = _launch(["--nproc-per-node", "4", *flags, "--", PYTHON, FLOOD, "200000", "200000"],
                  timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    check_flood(res.stdout, 4, 200000, 200000, prefixed=mode == "prefixed")


def test_a_reader_stalled_for_30_s_slows_the_job_down_and_loses_nothing(tmp_path):
    """`dtrain launch ... | (sleep 30; cat)`: the ranks wait for the reader (back-pressure)."""
    lines = 50000  # 4 ranks x ~2.3 MB prefixed: more than every buffer on the way holds
    with open(tmp_path / "stderr", "wb") as err:
        head = subprocess.Popen(
            dtrain_cmd(["launch", *FAST_BEATS, "--nproc-per-node", "4", "--",
                        PYTHON, FLOOD, str(lines), "200000"]),
            stdout=subprocess.PIPE, stderr=err, env=dtrain_env(), cwd=REPO)
        try:
            time.sleep(30)
            assert head.poll() is None, "the job ended while nobody read its output"
            stdout, _ = head.communicate(timeout=120)
        finally:
            head.kill()
            head.communicate()
    stderr = (tmp_path / "stderr").read_text(errors="replace")
    assert head.returncode == 0, stderr[-2000:]
    check_flood(stdout, 4, lines, 200000, prefixed=True)


def test_log_dir_keeps_each_run_in_its_own_folder_and_says_where(tmp_path):
    logs = tmp_path / "logs"
    runs = []
    for word in ("first", "second"):
        res = run_dtrain(["launch", "--nproc-per-node", "2", "--log-dir", str(logs), "--",
                          PYTHON, "-c", f"print('{word}')"])
        assert res.returncode == 0, res.stderr
        where = re.search(r"dtrain: rank logs in (\S+)/\n", res.stderr)
        assert where, res.stderr
        runs.append(Path(where.group(1)))
    assert runs[0] != runs[1] and sorted(logs.iterdir()) == sorted(runs)
    for run, word in zip(runs, ("first", "second"), strict=True):
        assert sorted(p.name for p in run.iterdir()) == ["rank-0.log", "rank-1.log"]
        assert (run / "rank-1.log").read_text() == f"{word}\n"


def test_two_hosts_flooding_over_ssh_lose_nothing(netns_cluster):
    """2 namespace hosts x 2 ranks through paramiko channels: the SSH window carries the
    back-pressure, and every line still arrives whole and in order."""
    res = _launch(["-H", "node1:2,node2:2", "--ssh-config", str(netns_cluster.ssh_config),
                   "--", PYTHON, FLOOD, "100000", "200000"], timeout=180)
    left = netns_cluster.wait_no_job_pids(10)
    assert res.returncode == 0, res.stderr[-2000:]
    check_flood(res.stdout, 4, 100000, 200000, prefixed=True)
    assert b"[1@node1] 1 0 " in res.stdout and b"[2@node2] 2 0 " in res.stdout
    assert not left, f"job processes left on hosts: {left}"


def test_a_rank_whose_child_keeps_printing_after_it_exits_still_ends_the_job(tmp_path):
    """The child holds the rank's pipes open and keeps them busy: the exit is reported after a
    bounded wait, and the rank's process group (the child) is stopped with it."""
    code = ("import os, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time\\n"
            "while True: print(\"tick\", flush=True); time.sleep(0.01)'])\n"
            "open(os.environ['PID_FILE'], 'w').write(str(child.pid))\n"
            "time.sleep(0.5)\n")
    pid_file = tmp_path / "child.pid"
    t0 = time.monotonic()
    res = subprocess.run(dtrain_cmd(["launch", *FAST_BEATS, "--", PYTHON, "-c", code]),
                         capture_output=True, timeout=60, cwd=REPO,
                         env=dtrain_env({"PID_FILE": str(pid_file)}))
    child = int(pid_file.read_text())
    try:
        assert res.returncode == 0, res.stderr[-2000:]
        assert time.monotonic() - t0 < 30
        assert b"[0@localhost] tick\n" in res.stdout
        assert not wait_gone([child], 10)
    finally:
        kill_recorded([child])


def test_two_ctrl_c_end_a_job_whose_stdout_nobody_reads(tmp_path):
    """Back-pressure holds ranks while the reader is stalled; a second Ctrl-C still ends the
    job (exit 130) and leaves no rank behind, dropping the output nobody would read: the
    agents' exit reports are read past it at once, then queued output gets its 2 s drain
    (KILLED_DRAIN_S), where the head used to wait out its 5 s give-up timer and 5 s more for
    each agent to leave (12.7 s)."""
    code = ("import os, sys\n"
            "open(os.path.join(os.environ['PID_DIR'], os.environ['RANK']), 'w')"
            ".write(str(os.getpid()))\n"
            "while True: sys.stdout.write('flood ' * 10 + '\\n')\n")
    with open(tmp_path / "stderr", "wb") as err:
        head = subprocess.Popen(
            dtrain_cmd(["launch", *FAST_BEATS, "--nproc-per-node", "2", "--grace", "1", "--",
                        PYTHON, "-c", code]),
            stdout=subprocess.PIPE, stderr=err, cwd=REPO,
            env=dtrain_env({"PID_DIR": str(tmp_path)}))
        pids: list[int] = []
        try:
            deadline = time.monotonic() + 30
            while len(pids) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
                pids = [int(t) for t in (p.read_text() for p in tmp_path.glob("[0-9]"))
                        if t.isdigit() and int(t) > 0]
            time.sleep(2)  # every buffer on the way fills; the ranks block in write
            assert head.poll() is None
            head.send_signal(signal.SIGINT)
            time.sleep(0.5)
            head.send_signal(signal.SIGINT)
            second = time.monotonic()
            head.wait(timeout=30)
            assert head.returncode == 130, (tmp_path / "stderr").read_text()[-2000:]
            assert time.monotonic() - second < 8  # 2 s drain + the kill, not 5 + 5 + 2
            assert len(pids) == 2 and not wait_gone(pids, 10)
        finally:
            head.kill()
            head.wait()
            kill_recorded(pids)


def test_a_reader_that_leaves_early_like_head_lets_the_job_finish(tmp_path):
    """`dtrain launch ... | head -n 3`: printing stops, the job runs to its end with rc 0."""
    done = tmp_path / "done"
    code = ("import os, sys\n"
            "for i in range(200000): sys.stdout.write(f'{i} ' + 'x' * 40 + '\\n')\n"
            "sys.stdout.flush()\n"
            "open(os.environ['DONE'] + os.environ['RANK'], 'w').close()\n")
    head = subprocess.Popen(
        dtrain_cmd(["launch", *FAST_BEATS, "--nproc-per-node", "2", "--", PYTHON, "-c", code]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
        env=dtrain_env({"DONE": str(done)}))
    try:
        assert head.stdout is not None
        first = [head.stdout.readline() for _ in range(3)]
        head.stdout.close()  # the reader leaves; dtrain's next write gets EPIPE
        _, err = head.communicate(timeout=60)
        assert all(line.startswith(b"[") for line in first)
        assert head.returncode == 0, err[-2000:]
        assert (tmp_path / "done0").exists() and (tmp_path / "done1").exists()
    finally:
        head.kill()
        head.communicate()


def test_the_exit_report_shows_the_last_stderr_lines_of_a_rank_that_flooded_then_failed():
    code = ("import sys\n"
            "sys.stderr.write(''.join(f'err {i}\\n' for i in range(100000)))\n"
            "sys.stderr.write('unfinished')\n"
            "sys.exit(3)\n")
    res = _launch(["--", PYTHON, "-c", code], timeout=60)
    assert res.returncode == 3
    err = res.stderr.decode()
    report = err[err.index("dtrain: job ended with exit code 3"):]
    assert "[0@localhost] unfinished\n" in err[:err.index("dtrain: job ended")]
    tail = report[report.index("last stderr lines of rank 0@localhost"):].splitlines()[1:]
    assert tail[:10] == [f"err {i}" for i in range(99991, 100000)] + ["unfinished"]


def test_an_unusable_log_dir_is_one_clear_error_before_anything_starts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    marker = tmp_path / "ran"
    res = run_dtrain(["launch", "--log-dir", str(blocker / "logs"), "--", PYTHON, "-c",
                      f"open({str(marker)!r}, 'w')"])
    assert res.returncode == 2
    assert res.stderr.count("dtrain: error: cannot write the rank logs [--log-dir ") == 1
    assert "Not a directory" in res.stderr and not marker.exists()
