"""MPI through `dtrain launch` with no mpirun: PMI-1 served by the agents, real MPICH ranks."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
import time

import pytest

from tests.support import (
    PYTHON,
    dtrain_cmd,
    dtrain_env,
    kill_recorded,
    run_dtrain,
    wait_for_lines,
    wait_gone,
)

ALLREDUCE = "from mpi4py import MPI; c = MPI.COMM_WORLD; print('sum', c.allreduce(c.rank + 1))"


def test_local_ranks_form_one_mpi_world():
    res = run_dtrain(["launch", "--nproc-per-node", "3", "--", PYTHON, "-c", ALLREDUCE])
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("sum 6") == 3


def test_pmi_port_mode_forms_the_same_world():
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--pmi", "port", "--", PYTHON, "-c",
                      ALLREDUCE])
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("sum 3") == 2


FORGER = textwrap.dedent("""
    import os, socket, time
    host, port = os.environ["PMI_PORT"].rsplit(":", 1)
    def forged(payload):
        s = socket.create_connection((host, int(port)))
        s.sendall(payload)
        s.settimeout(5)
        try:
            return s.recv(4096)
        except OSError:
            return b""
        finally:
            s.close()
    if os.environ["RANK"] == "0":
        forged(b"cmd=initack pmiid=12345\\n")            # an id nobody was given
        forged(b"\\x00\\xffgarbage without a command\\n")  # not PMI at all
        forged(b"cmd=put key=" + b"x" * 100000)          # oversized, no newline
    from mpi4py import MPI
    c = MPI.COMM_WORLD
    if c.rank == 0:
        # Claim this rank a second time while the real connection holds it: every rank has
        # connected (MPI_Init waited for all), so the port is closed.
        try:
            reply = forged(("cmd=initack pmiid=" + os.environ["PMI_ID"] + "\\n").encode())
        except ConnectionRefusedError:
            reply = b"refused: the port is closed"
        print("duplicate answered", reply[:40])
    print("sum", c.allreduce(c.rank + 1), flush=True)
""")


def test_forged_and_malformed_pmi_connections_are_refused_without_harming_the_job():
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--pmi", "port", "--", PYTHON, "-c",
                      FORGER], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("sum 3") == 2
    assert "duplicate answered b'refused: the port is closed'" in res.stdout  # not served


def test_mpi_abort_ends_the_job_with_its_exit_code():
    code = ("from mpi4py import MPI; import time\n"
            "c = MPI.COMM_WORLD\n"
            "if c.rank == 1:\n    c.Abort(42)\n"
            "time.sleep(60)\n")
    res = run_dtrain(["launch", "--nproc-per-node", "3", "--grace", "2", "--", PYTHON, "-c", code])
    assert res.returncode == 42
    assert "aborted by rank 1@localhost" in res.stderr


def test_a_rank_that_leaves_without_finalize_fails_the_job():
    code = ("from mpi4py import MPI; import os, time\n"
            "c = MPI.COMM_WORLD\n"
            "c.Barrier()\n"
            "if c.rank == 1:\n    os._exit(0)\n"
            "time.sleep(60)\n")
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--grace", "2", "--", PYTHON, "-c", code])
    assert res.returncode == 1
    assert "rank 1@localhost: closed its PMI connection before finalize" in res.stderr


def test_a_stalled_mpi_init_names_the_rank_it_waits_for():
    code = ("import os, time\n"
            "if os.environ['RANK'] == '2':\n    time.sleep(60)\n"
            "from mpi4py import MPI\n")
    res = run_dtrain(["launch", "--nproc-per-node", "3", "--pmi-stall", "1", "--timeout", "4",
                      "--grace", "1", "--", PYTHON, "-c", code])
    assert res.returncode == 124
    assert "has waited 1s for ranks 2@localhost\n" in res.stderr


def test_a_rank_killed_by_sigkill_after_mpi_init_exits_137_not_the_pmi_close_code():
    # The OOM killer's SIGKILL closes the rank's PMI socket before its exit status reaches the
    # agent: the job's exit code and its first failure must still say SIGKILL.
    code = ("from mpi4py import MPI; import os, signal, time\n"
            "c = MPI.COMM_WORLD\n"
            "c.Barrier()\n"
            "if c.rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
            "time.sleep(60)\n")
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--grace", "2", "--", PYTHON, "-c", code])
    assert res.returncode == 137, res.stderr
    assert "first failure: rank 1@localhost: killed by SIGKILL" in res.stderr
    assert "closed its PMI connection" not in res.stderr


# Another local user's flood of the agent's PMI_PORT: many connections, each sending a byte now
# and then (what used to reset the silence timer), for as long as it lives.
FLOOD = textwrap.dedent("""
    import socket, sys, time
    port, count = int(sys.argv[1]), int(sys.argv[2])
    held, until = [], time.monotonic() + 10
    while len(held) < count and time.monotonic() < until:
        try:
            held.append(socket.create_connection(("127.0.0.1", port), timeout=0.2))
        except OSError:
            pass
    print("flooding", flush=True)
    while held:
        time.sleep(0.5)
        for s in list(held):
            try:
                s.send(b"x")
            except OSError:
                held.remove(s)
""")
# Each rank has a progress record the agent reads every second, as trainer ranks do.
WAIT_FOR_THE_FLOOD = textwrap.dedent("""
    import os, time
    with open(os.environ["DTRAIN_PROGRESS_FILE"], "wb") as f:
        f.write(bytes(4096))
    report = os.environ["REPORT_DIR"]
    if os.environ["RANK"] == "0":
        with open(os.path.join(report, "port.tmp"), "w") as f:
            f.write(os.environ["PMI_PORT"].rsplit(":", 1)[1] + "\\n")
        os.rename(os.path.join(report, "port.tmp"), os.path.join(report, "port"))
    while not os.path.exists(os.path.join(report, "go")):
        time.sleep(0.05)
    from mpi4py import MPI
    c = MPI.COMM_WORLD
    print("sum", c.allreduce(c.rank + 1), flush=True)
""")
NOBODY = 65534


@pytest.fixture
def as_another_user() -> list[str]:
    """The command prefix that runs a program as `nobody`, with the system Python."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or shutil.which("setpriv") is None or python is None:
        pytest.skip("needs root, setpriv and a system python3 to act as a second user")
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--", python]


def test_a_flood_of_connections_to_the_pmi_port_does_not_end_the_job(tmp_path, as_another_user):
    # The agent may hold 256 files (a common default is 1024); the flood opens 600.
    head = subprocess.Popen(["prlimit", "--nofile=256:256", "--", *dtrain_cmd([
        "launch", "--nproc-per-node", "2", "--pmi", "port", "--env", f"REPORT_DIR={tmp_path}",
        "--", PYTHON, "-c", WAIT_FOR_THE_FLOOD])], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=dtrain_env())
    flood = None
    try:
        [port] = wait_for_lines(tmp_path / "port", 1)
        flood = subprocess.Popen([*as_another_user, "-c", FLOOD, port, "600"],
                                 stdout=subprocess.PIPE, text=True)
        assert flood.stdout is not None and flood.stdout.readline() == "flooding\n"
        time.sleep(2.5)  # two progress readings of the agent while the flood holds its files
        (tmp_path / "go").touch()
        out, err = head.communicate(timeout=120)
        assert head.returncode == 0, err
        assert out.count("sum 3") == 2
    finally:
        kill_recorded([p.pid for p in (head, flood) if p is not None])
        for p in (head, flood):
            if p is not None:
                p.wait()
    assert not wait_gone([flood.pid], 5)


def test_the_pmi_port_closes_once_every_rank_has_connected():
    code = ("from mpi4py import MPI; import os, socket\n"
            "c = MPI.COMM_WORLD\n"
            "c.Barrier()\n"
            "port = int(os.environ['PMI_PORT'].rsplit(':', 1)[1])\n"
            "try:\n"
            "    socket.create_connection(('127.0.0.1', port), timeout=5).close()\n"
            "    print('port open', flush=True)\n"
            "except ConnectionRefusedError:\n"
            "    print('port closed', flush=True)\n"
            "print('sum', c.allreduce(c.rank + 1), flush=True)\n")
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--pmi", "port", "--", PYTHON, "-c",
                      code])
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("port closed") == 2 and res.stdout.count("sum 3") == 2
