"""The stack-only hang diagnosis of a program dtrain sees no record of (neither its trainer,
torch.distributed nor MPI): every rank sleeps for the hang timeout, so the job counts as hung
and the headline says where each rank is, by its stack (py-spy)."""

from __future__ import annotations

import re

from tests.support import PYTHON, REPO, run_dtrain

WORKER = str(REPO / "tests" / "support" / "workers" / "file_wait.py")
HANG_TIMEOUT = 3.0


def test_a_program_without_records_gets_each_ranks_stack_as_its_diagnosis(tmp_path):
    logs = tmp_path / "logs"
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--hang-timeout", str(HANG_TIMEOUT),
                      "--hang-action", "abort", "--grace", "1", "--log-dir", str(logs), "--",
                      PYTHON, WORKER, str(tmp_path)], timeout=240)
    assert res.returncode == 123, res.stderr[-3000:]
    (path,) = logs.glob("*/hang-1.txt")
    text = path.read_text()
    first = text.splitlines()[0]
    assert ("cause: no rank keeps a record of its communication (it uses neither "
            "torch.distributed, MPI nor dtrain's trainer), so no operation can be blamed; every "
            "rank sleeps or blocks: ranks 0, 1 (localhost) are in wait_for (file_wait.py:") \
        in first, text
    stalled = float(re.search(r"no rank made progress for ([\d.]+)s", first)[1])
    assert stalled < HANG_TIMEOUT + 3, first
    assert "stack of rank 0" in text and "stack of rank 1" in text, text
    assert "main (file_wait.py:" in text
