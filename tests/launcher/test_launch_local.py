"""`dtrain launch` on localhost (no hostfile): the same agent as remote hosts, as a subprocess."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support import (
    PYTHON,
    REPO,
    alive,
    dtrain_cmd,
    dtrain_env,
    kill_recorded,
    run_dtrain,
    start_dtrain,
    wait_for_lines,
    wait_gone,
)

PROBE = str(REPO / "tests" / "support" / "workers" / "probe.py")


def _rank_lines(stdout: str) -> dict[int, str]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("[") and "@" in line:
            tag, _, rest = line.partition("] ")
            out[int(tag[1:].split("@")[0])] = rest
    return out


def _recorded_pids(pid_dir: Path) -> list[int]:
    return [int(p) for f in pid_dir.glob("*.pid") for p in f.read_text().split()]


def test_no_hostfile_runs_n_local_ranks_with_the_torchrun_contract():
    res = run_dtrain(["launch", "--nproc-per-node", "3", "--env", "PROBE_EXTRA=a b=c",
                      "--", PYTHON, PROBE, "env"],
                     env={"PMIX_RANK": "9", "SLURM_JOB_ID": "1", "OMPI_COMM_WORLD_RANK": "3"})
    assert res.returncode == 0, res.stderr
    envs = {r: json.loads(line) for r, line in _rank_lines(res.stdout).items()}
    assert sorted(envs) == [0, 1, 2]
    ports = {e["MASTER_PORT"] for e in envs.values()}
    jobs = {e["DTRAIN_JOB_ID"] for e in envs.values()}
    assert len(ports) == 1 and len(jobs) == 1
    for rank, e in envs.items():
        assert e["RANK"] == e["PMI_RANK"] == str(rank)
        assert e["LOCAL_RANK"] == str(rank)
        assert e["WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == e["PMI_SIZE"] == "3"
        assert e["GROUP_RANK"] == e["NODE_RANK"] == "0"
        assert e["MASTER_ADDR"] == "127.0.0.1"
        assert e["OMP_NUM_THREADS"] == "1"
        assert e["PROBE_EXTRA"] == "a b=c"
        assert e["CUDA_VISIBLE_DEVICES"] is None
        assert e["scrubbed"] == []
    assert "3 ranks on 1 host exited 0" in res.stderr


def test_awkward_arguments_arrive_byte_exact():
    awkward = ["a b", "'single'", '"double"', "$(touch /tmp/dtrain-pwned)", "; echo no",
               "line1\nline2", "`id`", "", "ünïcödé", "*", "--flag=x y", "\\"]
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--", PYTHON, PROBE, "argv", *awkward])
    assert res.returncode == 0, res.stderr
    lines = _rank_lines(res.stdout)
    assert [json.loads(lines[r]) for r in (0, 1)] == [awkward, awkward]
    assert not Path("/tmp/dtrain-pwned").exists()


def test_first_failing_rank_stops_every_rank_and_sets_the_exit_code(tmp_path):
    res = run_dtrain(["launch", "--nproc-per-node", "3", "--grace", "2", "--",
                      PYTHON, PROBE, "fail", "1", "7"], env={"PROBE_PID_DIR": str(tmp_path)})
    pids = _recorded_pids(tmp_path)
    try:
        assert res.returncode == 7
        assert "first failure: rank 1@localhost: exited with code 7" in res.stderr
        assert "rank 1 failing on purpose" in res.stderr  # last stderr lines of the failed rank
        assert len(pids) == 3 and not wait_gone(pids, 10)
    finally:
        kill_recorded(pids)


def test_rank_killed_by_a_signal_reports_128_plus_the_signal(tmp_path):
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--", PYTHON, PROBE, "signal", "0",
                      str(int(signal.SIGKILL))], env={"PROBE_PID_DIR": str(tmp_path)})
    pids = _recorded_pids(tmp_path)
    try:
        assert res.returncode == 137
        assert "killed by SIGKILL" in res.stderr
        assert not wait_gone(pids, 10)
    finally:
        kill_recorded(pids)


def test_children_a_rank_started_are_stopped_with_it(tmp_path):
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--timeout", "3", "--grace", "1", "--",
                      PYTHON, PROBE, "child", "60"], env={"PROBE_PID_DIR": str(tmp_path)})
    pids = _recorded_pids(tmp_path)
    try:
        assert res.returncode == 124
        assert len(pids) == 4 and not wait_gone(pids, 10)
    finally:
        kill_recorded(pids)


@pytest.mark.parametrize("second_ctrl_c", [False, True])
def test_ctrl_c_stops_every_rank_and_exits_130(tmp_path, second_ctrl_c):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    head = start_dtrain(["launch", "--nproc-per-node", "2", "--grace", "30", "--",
                         PYTHON, "-c", "import os, signal, time; signal.signal(signal.SIGINT, "
                         "signal.SIG_IGN); open(os.environ['PROBE_PID_DIR'] + '/' + "
                         "os.environ['RANK'] + '.pid', 'w').write(str(os.getpid())); "
                         "time.sleep(120)"],
                        env={"PROBE_PID_DIR": str(pid_dir)})
    pids: list[int] = []
    try:
        for rank in (0, 1):
            pids += [int(x) for x in wait_for_lines(pid_dir / f"{rank}.pid", 1)]
        head.send_signal(signal.SIGINT)
        if second_ctrl_c:
            time.sleep(0.5)
            head.send_signal(signal.SIGINT)
        # The ranks ignore SIGINT: one Ctrl-C waits out the 30 s grace, two kill at once.
        t0 = time.monotonic()
        if second_ctrl_c:
            _, err = head.communicate(timeout=15)
            assert head.returncode == 130
            assert time.monotonic() - t0 < 10
            assert not wait_gone(pids, 10)
        else:
            time.sleep(2)
            assert head.poll() is None and all(alive(p) for p in pids)
            head.send_signal(signal.SIGINT)
            head.communicate(timeout=15)
            assert head.returncode == 130
    finally:
        head.kill()
        head.communicate()
        kill_recorded(pids)


def test_sigkill_of_the_head_leaves_no_rank_behind(tmp_path):
    head = start_dtrain(["launch", "--nproc-per-node", "2", "--", PYTHON, PROBE, "child", "120"],
                        env={"PROBE_PID_DIR": str(tmp_path)})
    pids: list[int] = []
    try:
        for rank in (0, 1):
            pids += [int(x) for x in wait_for_lines(tmp_path / f"{rank}.pid", 2)]
        head.kill()
        head.communicate(timeout=10)
        assert not wait_gone(pids, 10)
    finally:
        kill_recorded(pids)


def test_timeout_stops_the_job_with_exit_code_124(tmp_path):
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--timeout", "1.5", "--grace", "1",
                      "--", PYTHON, PROBE, "sleep", "60"], env={"PROBE_PID_DIR": str(tmp_path)})
    pids = _recorded_pids(tmp_path)
    try:
        assert res.returncode == 124
        assert "stopped by --timeout" in res.stderr
        assert not wait_gone(pids, 10)
    finally:
        kill_recorded(pids)


def test_dry_run_prints_hosts_ranks_and_environment_and_starts_nothing(tmp_path):
    res = run_dtrain(["launch", "--dry-run", "--nproc-per-node", "2", "--env", "FOO=bar",
                      "--", PYTHON, PROBE, "env"], env={"PROBE_PID_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    assert "2 ranks on 1 host" in res.stdout
    assert "rank 1@localhost:" in res.stdout and "LOCAL_RANK=1" in res.stdout
    assert "FOO=bar" in res.stdout
    assert not list(tmp_path.glob("*.pid"))


def test_dry_run_shows_master_port_as_chosen_at_start_up_unless_it_was_given():
    res = run_dtrain(["launch", "--dry-run", "--nproc-per-node", "2", "--", PYTHON, PROBE, "env"])
    assert res.returncode == 0, res.stderr
    ranks = [x for x in res.stdout.splitlines() if x.strip().startswith("rank ")]
    assert len(ranks) == 2
    assert all("MASTER_PORT=<chosen-at-start-up>" in x for x in ranks), ranks
    assert "29500" not in res.stdout  # no port the real run would not use
    given = run_dtrain(["launch", "--dry-run", "--master-port", "29123", "--", PYTHON, PROBE])
    assert "MASTER_PORT=29123" in given.stdout and "MASTER_PORT=<" not in given.stdout


def test_log_dir_gets_one_file_per_rank_and_no_prefix_prints_bare_lines(tmp_path):
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--no-prefix", "--log-dir",
                      str(tmp_path / "logs"), "--", PYTHON, PROBE, "argv", "x"])
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ['["x"]', '["x"]']
    (run,) = (tmp_path / "logs").iterdir()  # one folder per run, named by its job id
    assert sorted(p.name for p in run.iterdir()) == ["rank-0.log", "rank-1.log"]
    assert (run / "rank-1.log").read_text() == '["x"]\n'


def test_a_missing_program_is_reported_before_any_rank_starts():
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--", "no-such-program-xyz", "a"])
    assert res.returncode != 0
    assert "program not found [host localhost]" in res.stderr
    assert "no-such-program-xyz" in res.stderr


def test_partial_lines_and_carriage_returns_keep_their_rank_prefix():
    code = ("import sys, time; sys.stdout.write('10%\\r'); sys.stdout.flush(); "
            "sys.stdout.write('100%\\r\\ndone'); sys.stdout.flush()")
    res = subprocess.run(dtrain_cmd(["launch", "--", PYTHON, "-c", code]), capture_output=True,
                         timeout=60, env=dtrain_env(), cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert res.stdout == b"[0@localhost] 10%\r[0@localhost] 100%\r\n[0@localhost] done\n"


def test_an_unmodified_torch_env_script_runs():
    script = str(REPO / "tests" / "support" / "workers" / "torch_env_script.py")
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--", PYTHON, script], timeout=120)
    assert res.returncode == 0, res.stderr
    assert "rank 0 of 2 sum 3" in res.stdout and "rank 1 of 2 sum 3" in res.stdout


def test_timings_show_when_each_start_up_phase_completed_and_the_agents_own_phases():
    res = run_dtrain(["launch", "--timings", "--", PYTHON, PROBE, "argv"])
    assert res.returncode == 0, res.stderr
    line = next(x for x in res.stderr.splitlines() if x.startswith("dtrain: timings"))
    names = [part.split()[0] for part in line.split("start: ", 1)[1].split(", ")]
    assert names == ["connected", "hello", "ready", "running", "exit"]
    line = next(x for x in res.stderr.splitlines() if x.startswith("dtrain: agents"))
    phases = re.findall(r"(\w+) ([0-9.]+)s \(localhost\)", line)
    assert [name for name, _ in phases] == ["boot", "check", "spawn"]
    assert all(0 < float(seconds) < 60 for _, seconds in phases)


def test_raw_mode_passes_output_bytes_through_unchanged():
    code = ("import sys; sys.stdout.buffer.write(b'\\x1b[2K50%\\r\\xff\\xfepartial'); "
            "sys.stdout.flush()")
    res = subprocess.run(dtrain_cmd(["launch", "--raw", "--", PYTHON, "-c", code]),
                         capture_output=True, timeout=60, env=dtrain_env(), cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert res.stdout == b"\x1b[2K50%\r\xff\xfepartial"
