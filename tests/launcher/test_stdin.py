"""The head's stdin reaches rank 0 through `dtrain launch` (real ranks); others read /dev/null."""

from __future__ import annotations

import hashlib
import os
import pty
import subprocess

from launcher.head.stdin import may_read
from tests.support import PYTHON, REPO, dtrain_cmd, dtrain_env

READ_ALL = ("import hashlib, os, sys; data = sys.stdin.buffer.read(); "
            "print(os.environ['RANK'], len(data), hashlib.sha256(data).hexdigest())")


def _launch(args: list[str], stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(dtrain_cmd(["launch", "--no-prefix", *args]), input=stdin,
                          capture_output=True, timeout=120, env=dtrain_env(), cwd=REPO)


def test_stdin_reaches_rank_0_whole_with_its_eof_and_other_ranks_read_nothing():
    data = os.urandom(3 * 1024 * 1024)  # many times the flow-control window
    res = _launch(["--nproc-per-node", "2", "--", PYTHON, "-c", READ_ALL], data)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = sorted(res.stdout.decode().splitlines())
    assert lines == [f"0 {len(data)} {hashlib.sha256(data).hexdigest()}",
                     f"1 0 {hashlib.sha256(b'').hexdigest()}"]


def test_a_rank_0_that_never_reads_its_stdin_does_not_hold_up_the_job():
    res = _launch(["--nproc-per-node", "2", "--", PYTHON, "-c", "print('done')"],
                  os.urandom(4 * 1024 * 1024))
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines() == [b"done", b"done"]


def test_an_interactive_exchange_with_rank_0_works_line_by_line():
    code = ("import sys\n"
            "for line in sys.stdin:\n"
            "    print('echo', line.strip(), flush=True)\n"
            "    if line.strip() == 'quit': break\n")
    head = subprocess.Popen(dtrain_cmd(["launch", "--no-prefix", "--", PYTHON, "-c", code]),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dtrain_env(), cwd=REPO)
    try:
        assert head.stdin is not None and head.stdout is not None
        head.stdin.write(b"hello\n")
        head.stdin.flush()
        assert head.stdout.readline() == b"echo hello\n"  # answered before any EOF
        head.stdin.write(b"quit\n")
        head.stdin.flush()
        out, err = head.communicate(timeout=60)
        assert head.returncode == 0, err[-2000:]
        assert out == b"echo quit\n"
    finally:
        head.kill()
        head.communicate()


def test_stdin_is_left_unread_when_dtrain_runs_in_the_background_of_its_terminal():
    """`dtrain launch ... &`: a read would stop dtrain with SIGTTIN (mpiexec's old trap)."""
    pid, master = pty.fork()  # the child: a session whose controlling terminal is the pty
    if pid == 0:
        code = 1
        try:
            foreground = may_read(0)
            child = os.fork()
            if child == 0:
                os.setpgid(0, 0)  # a process group of its own: in the terminal's background
                os._exit(3 if may_read(0) else 2)
            _, status = os.waitpid(child, 0)
            code = 10 * foreground + os.waitstatus_to_exitcode(status)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    os.close(master)
    assert os.waitstatus_to_exitcode(status) == 12  # foreground: read; background: not
