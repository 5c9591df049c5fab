"""The fork server's stub (`testbed.forkstub`), which stands in for a test's rank process: it
forwards the launcher's signals to the rank, also when the rank has already ended."""

from __future__ import annotations

import signal
import subprocess
import sys

from testbed.forkstub import forwarder


def test_a_signal_is_forwarded_to_the_running_rank() -> None:
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        forwarder(rank.pid)(signal.SIGTERM, None)
        assert rank.wait(timeout=30) == -signal.SIGTERM
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()


def test_a_signal_after_the_rank_ended_is_not_an_error() -> None:
    # The launcher's SIGTERM can reach the stub after its rank exited and was reaped, before
    # the stub has read the exit status: that printed a traceback as the rank's output.
    rank = subprocess.Popen([sys.executable, "-c", "pass"])
    assert rank.wait(timeout=30) == 0
    forwarder(rank.pid)(signal.SIGTERM, None)
