"""The root-cause error of a failed job: the first failing rank's exception from the file torch's
``@record`` writes (`TORCHELASTIC_ERROR_FILE`, one per rank in the job's private folder on its
host), shown in the failure summary as torchrun's ChildFailedError shows it, else the rank's
last stderr lines (`launcher.errorfile`). Real torch, real namespace hosts, real torchrun.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from launcher.errorfile import RootCause, parse, read
from tests.support import PYTHON, REPO, dtrain_env, run_dtrain

SCRIPT = str(REPO / "tests" / "support" / "workers" / "record_raise.py")
RAISED = "ValueError: shard 2 of the data set is missing"
# The traceback's frames from the entry point down to the raise, as both launchers print them.
FRAMES = [r'File "[^"]*record_raise.py", line \d+, in main', r"load_shard\(int\(os.environ",
          r'File "[^"]*record_raise.py", line \d+, in load_shard',
          r'raise ValueError\(f"shard \{rank\} of the data set is missing"\)']


def _in_order(text: str, patterns: list[str]) -> bool:
    at = 0
    for p in patterns:
        m = re.compile(p).search(text, at)
        if m is None:
            return False
        at = m.end()
    return True


def test_the_first_failing_ranks_exception_and_traceback_are_the_summary_as_under_torchrun(
        cluster, tmp_path):
    res = run_dtrain(["launch", "-H", "node1:2,node2:2", "--ssh-config", str(cluster.ssh_config),
                      "--grace", "1", "--log-dir", str(tmp_path), "--", PYTHON, SCRIPT],
                     timeout=240)
    assert res.returncode == 1, res.stderr[-3000:]
    err = res.stderr
    assert f"first failure: rank 2@node2: exited with code 1 ({RAISED})" in err, err[-3000:]
    summary = err[err.index("--- root cause: rank 2@node2 raised " + RAISED + " ---"):]
    assert _in_order(summary, [r"Traceback \(most recent call last\)", *FRAMES, RAISED]), summary
    assert "--- last stderr lines of rank 2@" not in err  # the file's record replaces them
    assert not list(Path("/dev/shm").glob("dtrain-*/rank-2.error.json"))  # gone with the job
    ref = subprocess.run([str(REPO / ".venv" / "bin" / "torchrun"), "--standalone",
                          "--nproc-per-node", "4", SCRIPT], capture_output=True, text=True,
                         timeout=240, cwd=REPO, env=dtrain_env(None))
    assert ref.returncode == 1, ref.stderr[-3000:]
    root = ref.stderr[ref.stderr.index("Root Cause (first observed failure):"):]
    assert re.search(r"rank\s*: 2 \(local_rank: 2\)", root), root
    assert _in_order(root, [*FRAMES, RAISED]), root


def test_a_rank_failing_without_an_error_file_is_summarised_by_its_last_stderr_lines(tmp_path):
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--", PYTHON, "-c",
                      "import os, sys; sys.exit(f'plain failure {os.environ[\"RANK\"]}' "
                      "if os.environ['RANK'] == '1' else 0)"], timeout=120)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "--- root cause" not in res.stderr
    tail = res.stderr[res.stderr.index("--- last stderr lines of rank 1@localhost ---"):]
    assert "plain failure 1" in tail, res.stderr[-3000:]


def test_torchs_error_file_gives_its_exception_type_message_and_traceback(tmp_path):
    body = {"message": {"message": "KeyError: 'lr'", "extraInfo": {
        "py_callstack": "Traceback (most recent call last):\n  File \"t.py\", line 3, in main\n"
                        "KeyError: 'lr'\n", "timestamp": "1764290000"}}}
    path = tmp_path / "rank-0.error.json"
    path.write_text(json.dumps(body))
    found = read(str(path))
    assert found == RootCause("KeyError: 'lr'", "Traceback (most recent call last):\n  File "
                              "\"t.py\", line 3, in main\nKeyError: 'lr'")
    assert found.lines()[-1] == "KeyError: 'lr'"
    assert RootCause.from_json(found.to_json()) == found


def test_an_error_file_that_is_no_record_is_ignored_and_control_characters_are_escaped(tmp_path):
    assert parse(b"not json") is None and parse(b"[1, 2]") is None and parse(b"{}") is None
    assert parse(b'{"message": "RuntimeError: old format"}') == RootCause(
        "RuntimeError: old format")
    assert parse(json.dumps({"message": {"message": "E: \x1b[2Jgone"}}).encode()).message == \
        "E: \\x1b[2Jgone"
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"message": "E: x"}))
    link = tmp_path / "rank-1.error.json"
    link.symlink_to(target)
    assert read(str(link)) is None  # a link is never followed
    big = tmp_path / "rank-2.error.json"
    big.write_bytes(b" " * (2 << 20))
    assert read(str(big)) is None
    assert read(str(tmp_path / "absent.json")) is None
