"""`dtrain launch` as typed: grouped --help, programs given without `--`, option precedence."""

from __future__ import annotations

import pytest

from tests.support import PYTHON, REPO, run_dtrain

PROBE = str(REPO / "tests" / "support" / "workers" / "probe.py")


def test_launch_help_lists_its_options_in_named_sections_with_examples():
    res = run_dtrain(["launch", "--help"])
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    titles = [x for x in lines if x and not x.startswith(" ") and x.endswith(":")]
    assert titles == ["Hosts and slots:", "SSH:", "Environment:", "Output:",
                      "Failure handling:", "Restarts:", "MPI:",
                      "Rendezvous (agents started elsewhere join):", "Other:"]
    section = {}
    for line in lines:
        if line in titles:
            current = line
        elif line.strip().startswith("-"):
            names = [w.rstrip(",") for w in line.split() if w.startswith("--")]
            section[names[0]] = current
    assert section["--nproc-per-node"] == "Hosts and slots:"
    assert section["--ssh-config"] == "SSH:" and section["--env"] == "Environment:"
    assert section["--log-dir"] == "Output:" and section["--grace"] == "Failure handling:"
    assert section["--rendezvous-port"] == section["--token-file"] == titles[-2]
    assert "    dtrain launch --nproc-per-node 4 -- python train.py" in lines
    assert "the first N slots of every host; it wins over slots=" in " ".join(res.stdout.split())


def test_a_program_given_without_dashes_keeps_its_own_options():
    res = run_dtrain(["launch", "--dry-run", "-H", "localhost:1", PYTHON, "-m", "trainer.train",
                      "--timeout", "5", "--env", "X=1"])
    assert res.returncode == 0, res.stderr
    assert f"command: {PYTHON} -m trainer.train --timeout 5 --env X=1" in res.stdout


def test_an_unknown_option_before_the_program_hints_at_the_missing_dashes():
    res = run_dtrain(["launch", "--nproc-per-node", "2", "-m", "trainer.train"])
    assert res.returncode == 2
    assert "No such option '-m'. If it belongs to your program, put `--` before the program: " \
        "dtrain launch [OPTIONS] -- PROGRAM [ARGS]..." in res.stderr
    assert res.stderr.count("put `--`") == 1


def test_nproc_per_node_below_the_hostfile_slots_wins_with_one_warning(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=4\n")
    res = run_dtrain(["launch", "--dry-run", "-f", str(hostfile), "--nproc-per-node", "2",
                      "--", PYTHON, PROBE, "env"])
    assert res.returncode == 0, res.stderr
    assert "2 ranks on 1 host" in res.stdout
    warnings = [x for x in res.stderr.splitlines() if "warning" in x]
    assert warnings == [f"dtrain: warning: --nproc-per-node 2 differs from the host list "
                        f"(localhost slots=4) [{hostfile}:1]: --nproc-per-node wins, using the "
                        "first 2 slot(s) of every host. Drop one of the two to silence this"]
    same = run_dtrain(["launch", "--dry-run", "-f", str(hostfile), "--nproc-per-node", "4",
                       "--", PYTHON, PROBE, "env"])
    assert same.returncode == 0 and "warning" not in same.stderr


@pytest.mark.parametrize(("args", "error"), [
    (["--rendezvous-port", "29400"], "incomplete rendezvous options [--rendezvous-port]: "
     "--nnodes and --token-file not given"),
    (["--nnodes", "2"], "incomplete rendezvous options [--rendezvous-host/--nnodes]"),
    (["--rendezvous-port", "29400", "--nnodes", "2", "--token-file", "t", "-H", "node1:2"],
     "conflicting host options [--rendezvous-port]"),
    (["--rendezvous-port", "29400", "--nnodes", "2", "--token-file", "t", "--launcher", "slurm"],
     "conflicting launchers [--launcher slurm]: --rendezvous-port selects --launcher rendezvous"),
])
def test_a_half_or_conflicting_set_of_rendezvous_options_is_one_usage_error(args, error):
    res = run_dtrain(["launch", *args, "--", PYTHON, "-c", "pass"])
    assert res.returncode == 2
    assert res.stderr == f"dtrain: error: {error}" + res.stderr.split(error, 1)[1]
    assert res.stderr.count("error") == 1


def test_an_agent_without_the_heads_address_is_one_usage_error_naming_its_variable(tmp_path):
    res = run_dtrain(["agent", "--token-file", str(tmp_path / "t")])
    assert res.returncode == 2 and "Missing option '--rendezvous'" in res.stderr
    bad = run_dtrain(["agent", "--token-file", str(tmp_path / "t")],
                     env={"DTRAIN_RDZV_ENDPOINT": "head-0"})
    assert bad.returncode == 2
    assert "bad rendezvous address [--rendezvous]: 'head-0' is not HOST:PORT" in bad.stderr


LEAVE = """
import atexit, sys, threading
from launcher.cli import _leave
atexit.register(lambda: print("finalized"))
sys.stdout.write("report")  # buffered: a pipe
if sys.argv[1] == "thread":
    done = threading.Event()
    threading.Thread(target=done.wait, args=(0.5,)).start()  # not a daemon
_leave(5)
"""


@pytest.mark.parametrize("case", ["alone", "thread"])
def test_the_head_leaves_with_its_code_and_output_and_skips_finalization_only_when_alone(case):
    import subprocess

    out = subprocess.run([PYTHON, "-c", LEAVE, case], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert out.returncode == 5, out.stderr
    assert out.stdout == ("report" if case == "alone" else "reportfinalized\n")
