"""`dtrain launch --launcher mpirun`: the same plan as an MPICH Hydra or Open MPI command."""

from __future__ import annotations

import pytest

from launcher import mpirun
from launcher.errors import UsageError
from launcher.hosts.hostfile import parse_host_list, parse_hostfile_text
from launcher.hosts.selection import select_hosts
from launcher.plan.job import make_plan
from tests.support import PYTHON, run_dtrain


def _plan(hosts: str, **select):
    entries = (parse_hostfile_text(hosts, "hf") if "\n" in hosts else parse_host_list(hosts))
    return make_plan(select_hosts(entries, **select), argv=["python", "t.py", "a b"], cwd="/w",
                     job_id="job-1", master_addr="node1", master_port=29500,
                     base_env={"NCCL_DEBUG": "INFO"})


def test_hydra_command_carries_hosts_counts_and_the_shared_environment():
    cmd = mpirun.build_command(_plan("node1:2,node2:2"), mpirun="mpiexec", flavour="hydra",
                               python="/venv/bin/python")
    argv = list(cmd.argv)
    assert argv[:7] == ["mpiexec", "-launcher", "ssh", "-hosts", "node1:2,node2:2", "-n", "4"]
    assert ["-genv", "NCCL_DEBUG", "INFO"] == argv[argv.index("NCCL_DEBUG") - 1:][:3]
    assert ["-genv", "MASTER_ADDR", "node1"] == argv[argv.index("MASTER_ADDR") - 1:][:3]
    assert argv[-7:] == ["/venv/bin/python", "-m", "workerenv", "--", "python", "t.py", "a b"]
    assert "RANK" not in argv  # per-rank variables come from the workerenv shim


def test_open_mpi_command_uses_a_hostfile_map_by_slot_and_x_exports():
    cmd = mpirun.build_command(_plan("alice@node1 slots=2\nnode2 slots=1\n"), mpirun="mpirun",
                               flavour="openmpi", python="/venv/bin/python")
    argv = list(cmd.argv)
    assert argv[:6] == ["mpirun", "--hostfile", "{hostfile}", "-np", "3", "--map-by"]
    assert "-x" in argv and "NCCL_DEBUG=INFO" in argv and "WORLD_SIZE=3" in argv
    assert cmd.hostfile_text == "alice@node1 slots=2\nnode2 slots=1\n"


def test_gpu_slot_selection_is_refused_with_mpirun():
    with pytest.raises(UsageError, match="slot selection unsupported"):
        mpirun.build_command(_plan("node1:4", include="node1:1,2"), mpirun="mpiexec",
                             flavour="hydra", python="/p")


def test_mpi_ranks_under_hydra_get_the_torchrun_contract_and_the_exit_code_propagates(tmp_path):
    # Hydra forwards output without line boundaries, so ranks report through files.
    code = ("from mpi4py import MPI; import os, sys\n"
            "c = MPI.COMM_WORLD\n"
            "e = os.environ\n"
            "line = f\"{e['RANK']} {e['LOCAL_RANK']} {e['WORLD_SIZE']} {c.allreduce(1)}\"\n"
            "open(os.path.join(e['REPORT_DIR'], e['RANK']), 'w').write(line)\n"
            "sys.exit(3 if c.rank == 1 else 0)\n")
    res = run_dtrain(["launch", "--launcher", "mpirun", "-H", "localhost:2", "--env",
                      f"REPORT_DIR={tmp_path}", "--", PYTHON, "-c", code])
    assert res.returncode == 3, res.stderr
    assert (tmp_path / "0").read_text() == "0 0 2 2"
    assert (tmp_path / "1").read_text() == "1 1 2 2"


def test_dry_run_prints_the_mpi_command_without_running_it():
    res = run_dtrain(["launch", "--launcher", "mpirun", "--dry-run", "-H", "localhost:2", "--",
                      PYTHON, "-c", "raise SystemExit(9)"])
    assert res.returncode == 0, res.stderr
    assert "mpiexec" in res.stdout and "-hosts localhost:2" in res.stdout
