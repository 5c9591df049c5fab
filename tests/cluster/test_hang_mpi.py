"""Hang diagnosis for MPI programs that keep no progress record (`launcher.hang.mpi`): a rank
that left its program sits in MPI_Finalize's PMI barrier while the others wait in a collective.
Pure cores on py-spy's native stacks as it prints them; real mpi4py ranks under MPICH on
localhost and on network-namespace hosts.
"""

from __future__ import annotations

import re
import time

from launcher.hang import mpi
from launcher.hang.diagnose import diagnose
from launcher.hang.views import RankView
from tests.support import PYTHON, REPO, run_dtrain

WORKER = str(REPO / "tests" / "support" / "workers" / "mpi_leaves.py")
HANG_TIMEOUT = 3.0
SLACK_S = 30.0  # a sampling interval, the native stacks, start-up of MPI ranks under load

# `py-spy dump --native` of an mpi4py rank waiting in Allreduce (MPICH 5, ch4:ucx).
IN_ALLREDUCE = """Thread 26308 (active)
    sched_yield (libc.so.6)
    0x7f348091bf95 (libmpi.so.12)
    MPIR_Allreduce_impl (libmpi.so.12)
    PMPI_Allreduce_c (libmpi.so.12)
    Allreduce (mpi4py/MPI.mpich.cpython-311-x86_64-linux-gnu.so)
    main (train.py:22)
"""
COMPUTING = """Thread 26309 (active)
    dgemm_kernel (libopenblas.so.0)
    matmul (numpy/core/_multiarray_umath.so)
    main (train.py:19)
"""


def _ranks(fence: dict[int, float], size: int = 3) -> dict[int, RankView]:
    return {r: RankView(r, f"node{r}", pid=100 + r, state="no-record", fence_age=fence.get(r))
            for r in range(size)}


def test_the_mpi_call_of_a_native_stack_is_its_outermost_api_frame():
    assert mpi.mpi_call(IN_ALLREDUCE) == "MPI_Allreduce"
    assert mpi.mpi_call(COMPUTING) is None
    assert mpi.mpi_call("    PMPI_Init_thread (libmpi.so.12)\n    main (a.py:3)\n") == \
        "MPI_Init_thread"


def test_a_rank_in_mpi_finalize_while_the_others_wait_in_allreduce_is_named_first():
    seen = _ranks({1: 4.0})
    assert mpi.suspects(seen.values(), HANG_TIMEOUT) == ([1], [0, 2])
    views = mpi.views(seen, {0: IN_ALLREDUCE, 2: IN_ALLREDUCE}, HANG_TIMEOUT)
    found = diagnose(views)
    assert found.culprit_ranks == (1,) and found.kind == "finalizing", found.text
    assert found.blamed_hosts == ("node1",) and found.op == "MPI_Allreduce"
    assert found.headline == (
        "rank 1 (node1) is in MPI_Finalize for 4.0s: it has left its program (returned from its "
        "main or called exit) while others still communicate; ranks 0 (node0), 2 (node2) wait "
        "for it in MPI_Allreduce"), found.text


def test_a_rank_done_early_while_the_others_compute_or_start_is_no_hang():
    seen = _ranks({1: 4.0})
    assert mpi.views(seen, {0: COMPUTING, 2: IN_ALLREDUCE.replace("Allreduce", "Init")},
                     HANG_TIMEOUT) is None
    assert mpi.suspects(_ranks({1: 2.0}).values(), HANG_TIMEOUT) == ([], [])  # not for long
    assert mpi.suspects(_ranks({0: 4.0, 1: 4.0, 2: 5.0}).values(), HANG_TIMEOUT) == ([], [])


def test_an_mpi_rank_that_exits_while_its_peer_waits_in_allreduce_ends_the_job_naming_it(
        cluster, tmp_path):
    started = time.monotonic()
    res = run_dtrain(["launch", "-H", "node1:1,node2:1", "--ssh-config", str(cluster.ssh_config),
                      "--hang-timeout", str(HANG_TIMEOUT), "--hang-action", "abort", "--grace",
                      "1", "--log-dir", str(tmp_path), "--", PYTHON, WORKER], timeout=120)
    took = time.monotonic() - started
    assert res.returncode == 123, res.stderr[-3000:]
    (path,) = tmp_path.glob("*/hang-1.txt")
    first = path.read_text().splitlines()[0]
    assert re.search(
        r"cause: rank 1 \(node2\) is in MPI_Finalize for \d+\.\ds: it has left its program "
        r"\(returned from its main or called exit\) while others still communicate; rank 0 "
        r"\(node1\) waits for it in MPI_Allreduce$", first), first
    assert "first failure: rank 1@node2: hung (rank 1 (node2) is in MPI_Finalize" in res.stderr
    assert took < HANG_TIMEOUT + SLACK_S


def test_mpi_ranks_computing_while_one_waits_in_finalize_are_no_hang_until_they_wait(tmp_path):
    """Rank 1 is done at once; ranks 0 and 2 compute for 15 s (a hang timeout of 3 s is
    looked at five times meanwhile: their stacks show no MPI call), then wait for it."""
    started = time.monotonic()
    res = run_dtrain(["launch", "--nproc-per-node", "3", "--hang-timeout", str(HANG_TIMEOUT),
                      "--hang-action", "abort", "--grace", "1", "--log-dir", str(tmp_path),
                      "--", PYTHON, WORKER, "15"], timeout=120)
    assert res.returncode == 123, res.stderr[-3000:]
    assert time.monotonic() - started >= 15
    (path,) = tmp_path.glob("*/hang-1.txt")
    assert "cause: rank 1 (localhost) is in MPI_Finalize" in path.read_text()
    assert "ranks 0, 2 (localhost) wait for it in MPI_Allreduce" in path.read_text()
