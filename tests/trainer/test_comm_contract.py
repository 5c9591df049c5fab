"""The Communicator contract on real MPI processes (MPI backend, CPU), plus bootstrap checks.

One `mpiexec` run per world size (1, 2, 4) executes every case of
tests/support/comm_workers/contract.py:
every operation, fp32/fp16/bf16/int64, sync and async, on the world, on 2x2 splits both ways, on
a reversed-key split and on the three axes of a (dp, tp=2, pp=1) grid. The tests below read the
per-rank reports of that run, one test per operation, so a failure names the operation, the
communicator, dtype and mode, and shows got/expected.
"""

from __future__ import annotations

import functools
import json
import subprocess
import tempfile
from pathlib import Path

import pytest

from testbed.mpiexec import PYTHON, REPO, clean_env
from tests.support.mpi_runs import run_ranks
from trainer.comm.bandwidth import Sample, format_size, parse_size, parse_sizes
from trainer.comm.bootstrap import check_world
from trainer.errors import BootstrapError, ConfigError

WORKER = REPO / "tests" / "support" / "comm_workers" / "contract.py"
WORLD_SIZES = (1, 2, 4)
OPS = ("all_reduce_sum", "all_reduce_max", "all_reduce_min", "all_reduce_avg",
       "all_reduce_strided", "all_reduce_requires_grad", "all_gather", "all_gather_in_place",
       "reduce_scatter_sum", "reduce_scatter_max", "reduce_scatter_in_place", "broadcast_first",
       "broadcast_last", "broadcast_strided", "send_recv", "batch_p2p", "batch_p2p_empty",
       "all_to_all", "all_to_all_uneven", "all_to_all_all_to_one", "all_to_all_empty",
       "many_in_flight", "barrier", "errors", "bootstrap")
COMMS = ("world", "rows", "cols", "reversed", "grid_tp", "grid_dp", "grid_pp")


@functools.cache
def contract(world_size: int) -> tuple[int, str, tuple[dict, ...]]:
    """Run the worker once per world size; (exit code, output, per-rank reports)."""
    with tempfile.TemporaryDirectory(prefix="dtrain-contract-") as out:
        proc = run_ranks(world_size, [str(WORKER), "--out", out], timeout=150)
        reports = tuple(json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json")))
    return proc.returncode, proc.stdout, reports


def records(world_size: int) -> list[dict]:
    _, _, reports = contract(world_size)
    return [dict(r, rank=rep["rank"]) for rep in reports for r in rep["records"]]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_rank_finishes_the_contract_run_and_reports(world_size):
    code, output, reports = contract(world_size)
    assert sorted(r["rank"] for r in reports) == list(range(world_size)), output
    assert {r["size"] for r in reports} == {world_size}
    assert code == 0, output[-4000:]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_rank_ran_the_same_cases(world_size):
    _, _, reports = contract(world_size)
    names = [sorted(r["case"] for r in rep["records"]) for rep in reports]
    assert names and all(n == names[0] for n in names)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_operation_matches_the_serial_result_on_every_communicator(world_size, op):
    cases = [r for r in records(world_size) if r["op"] == op]
    if op == "send_recv" and world_size == 1:
        pytest.skip("blocking send/recv needs a peer; batch_p2p covers a rank sending to itself")
    assert cases, f"no {op} case ran at world size {world_size}"
    failed = [f"rank {r['rank']} {r['case']}: {r['error']}" for r in cases if not r["ok"]]
    assert not failed, "\n".join(failed[:10])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_covers_every_dtype_sync_and_async_on_every_communicator(world_size):
    seen = {(r["comm"], r["dtype"], r["async"]) for r in records(world_size)
            if r["op"] == "all_reduce_sum"}
    want = {(c, d, a) for c in COMMS for d in ("fp32", "fp16", "bf16", "int64")
            for a in (False, True)}
    assert seen == want


# -- bootstrap: the world check (pure) and one real mismatch ----------------------------------

CONTRACT = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0"}


def test_no_worker_contract_means_the_mpi_world_is_used():
    assert check_world(0, 2, {}, "MPICH Version: 5.0.2") is None


def test_matching_world_gives_the_contract_placement():
    placement = check_world(0, 4, CONTRACT, "MPICH Version: 5.0.2")
    got = (placement.rank, placement.size, placement.local_rank, placement.local_size)
    assert got == (0, 4, 0, 2)


def test_open_mpi_singleton_under_the_ssh_launcher_points_to_launcher_mpirun():
    with pytest.raises(BootstrapError) as err:
        check_world(0, 1, {**CONTRACT, "PMI_FD": "5"}, "Open MPI v5.0.3, package: Open MPI")
    text = str(err.value)
    assert "MPI.COMM_WORLD has 1 rank(s) but the launcher started 4" in text
    assert "--launcher mpirun" in text and "[rank 0 of WORLD_SIZE=4]" in text


def test_worker_without_pmi_points_to_dtrain_launch():
    with pytest.raises(BootstrapError, match=r"started\s+outside dtrain.*`dtrain launch`"):
        check_world(0, 1, CONTRACT, "MPICH Version: 5.0.2")


def test_rank_that_differs_from_mpi_rank_is_rejected():
    with pytest.raises(BootstrapError, match="MPI.COMM_WORLD rank is 3 but RANK is 0"):
        check_world(3, 4, CONTRACT, "MPICH Version: 5.0.2")


def test_python_started_by_hand_with_a_copied_world_size_fails_with_the_remedy():
    code = "from trainer.comm import bootstrap; bootstrap.init()"
    proc = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60,
                          check=False,
                          cwd=REPO, env=clean_env(CONTRACT))
    assert proc.returncode != 0
    assert "BootstrapError: MPI world does not match the job" in proc.stderr
    assert "dtrain launch" in proc.stderr


# -- diagnose ---------------------------------------------------------------------------------

def test_diagnose_under_plain_mpiexec_reports_every_rank_and_the_bandwidth_table():
    proc = run_ranks(2, ["-m", "trainer.diagnose", "--sizes", "1K,64K", "--iters", "3"],
                     timeout=90)
    assert proc.returncode == 0, proc.stdout[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}]" in proc.stdout
    assert "cpu: MPI backend" in proc.stdout
    assert "bus bandwidth" in proc.stdout and "grid_tp" in proc.stdout


# -- bandwidth arithmetic (shared by diagnose and bench) --------------------------------------

def test_message_sizes_parse_with_binary_units():
    assert parse_sizes("1K, 64k,16M,1G,512") == [1024, 65536, 16 << 20, 1 << 30, 512]
    assert format_size(16 << 20) == "16M" and format_size(1536) == "1536B"


@pytest.mark.parametrize("bad", ["", "K", "-1K", "1.5M", "12X"])
def test_malformed_message_size_names_itself(bad):
    with pytest.raises(ConfigError, match="invalid message size"):
        parse_size(bad)


def test_bus_bandwidth_uses_the_ring_factor_two_n_minus_one_over_n():
    sample = Sample.of(nbytes=1_000_000_000, ranks=4, seconds=1.0)
    assert sample.algbw_gbps == 1.0 and sample.busbw_gbps == 1.5
    assert Sample.of(1000, 1, 1.0).busbw_gbps == 0.0
