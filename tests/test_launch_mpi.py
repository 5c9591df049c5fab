"""MPI through `dtrain launch` with no mpirun: PMI-1 served by the agents, real MPICH ranks."""

from __future__ import annotations

import textwrap

from tests.support import PYTHON, run_dtrain

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
        # Claim this rank a second time while the real connection holds it.
        reply = forged(("cmd=initack pmiid=" + os.environ["PMI_ID"] + "\\n").encode())
        print("duplicate answered", reply[:40])
    print("sum", c.allreduce(c.rank + 1), flush=True)
""")


def test_forged_and_malformed_pmi_connections_are_refused_without_harming_the_job():
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--pmi", "port", "--", PYTHON, "-c",
                      FORGER], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("sum 3") == 2
    assert "duplicate answered b''" in res.stdout  # the claim was dropped, not served


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
