"""A session cleans up what a killed session left, reading only state it understands."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from testbed import netns, slurm
from testbed.stale import abandoned, process_key, record, remove_scratch, running

# Reaps state and kills recorded daemons as a new test session does: with no other session
# running beside it in make test (tests/conftest.py).
pytestmark = pytest.mark.alone

GONE = [os.getpid(), 0]  # this pid with another start time: a creator whose pid was reused


def _write(path: Path, state: dict) -> None:
    path.write_text(json.dumps(state))


def test_a_process_is_known_by_its_pid_and_start_time():
    key = process_key(os.getpid())
    assert key is not None and running(key)
    assert not running((os.getpid(), key[1] + 1))


def test_state_written_by_a_running_session_is_not_abandoned(tmp_path):
    record(tmp_path / "netns-live.json", namespaces=[], links=[])
    assert list(abandoned("netns", ("namespaces", "links"), tmp_path)) == []


def test_each_reaper_reads_only_its_own_kind_of_state_file(tmp_path):
    _write(tmp_path / "slurm-a.json", {"creator": GONE, "pids": []})
    _write(tmp_path / "netns-a.json", {"creator": GONE, "namespaces": [], "links": []})
    netns.reap_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slurm-a.json"]
    slurm.reap_stale(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_state_file_of_another_layout_is_skipped_and_named_not_fatal(tmp_path, capsys):
    _write(tmp_path / "netns-old.json", {"creator": 12345})
    _write(tmp_path / "slurm-old.json", {"creator": GONE})
    (tmp_path / "netns-torn.json").write_text('{"creator": [1')
    netns.reap_stale(tmp_path)
    slurm.reap_stale(tmp_path)
    assert len(list(tmp_path.iterdir())) == 3
    out = capsys.readouterr().out
    assert all(name in out for name in ("netns-old.json", "slurm-old.json", "netns-torn.json"))


def test_a_recorded_daemon_pid_now_held_by_another_process_is_not_killed(tmp_path):
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        key = process_key(bystander.pid)
        assert key is not None
        _write(tmp_path / "slurm-b.json", {"creator": GONE, "pids": [[key[0], key[1] - 1]]})
        slurm.reap_stale(tmp_path)
        assert not (tmp_path / "slurm-b.json").exists()
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_a_recorded_daemon_that_still_runs_is_killed(tmp_path):
    daemon = subprocess.Popen(["sleep", "60"])
    try:
        key = process_key(daemon.pid)
        assert key is not None
        _write(tmp_path / "slurm-c.json", {"creator": GONE, "pids": [list(key)]})
        slurm.reap_stale(tmp_path)
        assert daemon.wait(timeout=10) == -9
    finally:
        daemon.kill()
        daemon.wait()


def test_only_a_temporary_directory_named_like_ours_is_removed_for_a_dead_session(tmp_path):
    ours = Path(tempfile.mkdtemp(prefix="dtrain-netns-"))
    theirs = Path(tempfile.mkdtemp(prefix="someone-else-"))
    nested = tmp_path / "dtrain-netns-deeper"
    nested.mkdir()
    try:
        for scratch in (ours, theirs, nested):
            remove_scratch(str(scratch), "dtrain-netns-")
        assert (ours.exists(), theirs.exists(), nested.exists()) == (False, True, True)
    finally:
        theirs.rmdir()
