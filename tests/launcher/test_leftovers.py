"""A SIGKILLed agent's /dev/shm leftovers (its progress folder, its ranks' MPICH segments) are
removed by the next agent on the host, and nothing that is not provably a dead agent's is."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

from launcher.agent.leftovers import SHM, AgentMark, folder_prefix, is_dead, own_mark, parse
from launcher.pmi.actions import shm_segment_prefixes
from tests.support import (
    PYTHON,
    dtrain_cmd,
    dtrain_env,
    kill_recorded,
    run_dtrain,
    wait_for_lines,
    wait_gone,
)

OURS = AgentMark(pid=100, start=5000, pidns=4026531836)


def test_a_folder_name_carries_its_agents_mark_and_parses_back():
    mark = AgentMark(4242, 987654, 4026531836)
    name = folder_prefix("20261125-075733-4ff5ba", mark) + "x_y7Qz"
    assert parse(name) == ("20261125-075733-4ff5ba", mark)
    assert parse("dtrain-20261125-075733-4ff5ba-abc12345") is None  # an older dtrain's: kept
    assert parse("dtrain-netns-abc") is None


def starts(table: dict[int, int | None]):
    def start_of(pid: int) -> int | None:
        if pid not in table:
            raise PermissionError(pid)
        return table[pid]
    return start_of


@pytest.mark.parametrize("mark,table,dead", [
    (AgentMark(7, 11, OURS.pidns), {7: None}, True),       # no such process
    (AgentMark(7, 11, OURS.pidns), {7: 99}, True),         # the PID now names another process
    (AgentMark(7, 11, OURS.pidns), {7: 11}, False),        # the agent itself, still running
    (AgentMark(7, 11, OURS.pidns + 1), {7: None}, False),  # another namespace's PID 7
    (AgentMark(7, 11, OURS.pidns), {}, False),             # /proc cannot tell
], ids=["gone", "pid-reused", "alive", "other-namespace", "unknown"])
def test_an_agent_is_dead_only_when_its_pid_is_provably_gone_in_this_namespace(mark, table, dead):
    assert is_dead(mark, OURS, starts(table)) is dead


IN_MPI = textwrap.dedent("""
    import json, os, time
    from mpi4py import MPI
    c = MPI.COMM_WORLD
    c.Barrier()
    e = os.environ
    report = os.path.join(e["REPORT_DIR"], str(c.rank))
    with open(report + ".tmp", "w") as f:
        json.dump({"agent": os.getppid(), "pid": os.getpid(), "job": e["DTRAIN_JOB_ID"],
                   "folder": os.path.dirname(e["DTRAIN_PROGRESS_FILE"])}, f)
    os.rename(report + ".tmp", report)
    time.sleep(120)
""")


def shm_of(job: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM) if n.startswith(shm_segment_prefixes(job)))


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.fixture
def planted():
    """Entries in /dev/shm named like dead agents' folders that are not ours to remove;
    removed by exact name afterwards, with the test's own leftovers."""
    made: list[Path] = []
    yield made
    for path in made:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)


def test_the_next_agent_removes_what_a_sigkilled_agent_left_and_nothing_else(tmp_path, planted):
    ours = own_mark()
    assert ours is not None
    head = subprocess.Popen(dtrain_cmd(["launch", "--nproc-per-node", "2", "--env",
                                        f"REPORT_DIR={tmp_path}", "--", PYTHON, "-c", IN_MPI]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dtrain_env())
    ranks = []
    try:
        wait_for_lines(tmp_path / "0", 1), wait_for_lines(tmp_path / "1", 1)
        ranks = [json.loads((tmp_path / r).read_text()) for r in ("0", "1")]
        job, folder = ranks[0]["job"], Path(ranks[0]["folder"])
        planted += [folder, *(Path(SHM) / n for n in shm_of(job))]  # cleaned up whatever happens
        os.kill(ranks[0]["agent"], signal.SIGKILL)  # as the OOM killer would
        assert head.wait(60) == 255
        assert not wait_gone([r["pid"] for r in ranks], 10)  # parent-death signal
    finally:
        kill_recorded([head.pid] + [r["pid"] for r in ranks])
        head.wait()
    assert folder.is_dir() and shm_of(job), "the killed agent left nothing to remove"

    # What the next agent must leave alone, each named as a dead agent's folder.
    gone = AgentMark(dead_pid(), 1, ours.pidns)
    others = Path(SHM) / (folder_prefix("other-user", gone) + "k1")
    others.mkdir()
    os.chown(others, 65534, 65534)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    link = Path(SHM) / (folder_prefix("a-link", gone) + "k2")
    link.symlink_to(outside)
    alive = Path(SHM) / (folder_prefix("alive", ours) + "k3")
    alive.mkdir()
    elsewhere = Path(SHM) / (folder_prefix("other-ns", AgentMark(gone.pid, 1, ours.pidns + 1))
                             + "k4")
    elsewhere.mkdir()
    planted += [others, link, alive, elsewhere]

    res = run_dtrain(["launch", "--nproc-per-node", "1", "--", PYTHON, "-c", "pass"])
    assert res.returncode == 0, res.stderr
    assert not folder.exists() and shm_of(job) == []
    assert others.is_dir() and link.is_symlink() and alive.is_dir() and elsewhere.is_dir()
    assert (outside / "keep").read_text() == "mine"


def test_a_sigkilled_relays_known_hosts_folder_is_named_as_its_agents_and_swept_after_it(
        tmp_path):
    """A relay keeps its hops' known_hosts in a folder the agent makes as its records folder
    (`launcher.agent.main` hands `Host.records_folder` to the relay): named with the agent's
    mark, so the next agent on the host removes it when the relay's agent was SIGKILLed."""
    import tempfile

    from launcher.agent.host import Host
    from launcher.agent.leftovers import sweep
    from launcher.tree.hops import RelayKeys

    ours = own_mark()
    assert ours is not None
    made = Path(Host().records_folder("relay"))
    try:
        assert parse(made.name) == ("relay", ours)
    finally:
        made.rmdir()
    gone = AgentMark(dead_pid(), 1, ours.pidns)
    keys = RelayKeys(tempfile.mkdtemp(prefix=folder_prefix("relay", gone), dir=tmp_path))
    keys.resolved("node5", {"hostname": "10.0.0.5", "port": 22, "user": "alice",
                            "identity_files": [], "identities_only": False,
                            "connect_timeout": 5.0, "known_hosts": ["10.0.0.5 ssh-ed25519 AAAA"]})
    assert keys.file.read_text() == "10.0.0.5 ssh-ed25519 AAAA\n"
    assert sweep(str(tmp_path), ours) == [keys.folder.name]
    assert not keys.folder.exists()
