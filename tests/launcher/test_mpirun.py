"""`dtrain launch --launcher mpirun`: the same plan as an MPICH Hydra or Open MPI command."""

from __future__ import annotations

import json
import os

import pytest

import workerenv
from launcher.errors import UsageError
from launcher.hosts.hostfile import parse_host_list, parse_hostfile_text
from launcher.hosts.selection import select_hosts
from launcher.mpirun import command as mpirun
from launcher.plan.job import Rendezvous, make_plan
from tests.support import (
    PYTHON,
    REPO,
    kill_recorded,
    run_dtrain,
    start_dtrain,
    wait_for_lines,
    wait_gone,
)

PROBE = str(REPO / "tests" / "support" / "workers" / "probe.py")


def _plan(hosts: str, **select):
    entries = (parse_hostfile_text(hosts, "hf") if "\n" in hosts else parse_host_list(hosts))
    return make_plan(select_hosts(entries, **select), argv=["python", "t.py", "a b"], cwd="/w",
                     job_id="job-1", base_env={"NCCL_DEBUG": "INFO"})


RDV = Rendezvous("node1", 29500)


def test_an_eager_start_under_mpirun_is_refused_once_before_anything_starts():
    res = run_dtrain(["launch", "--launcher", "mpirun", "--start", "eager", "--", PYTHON, "-c",
                      "pass"])
    assert res.returncode == 2 and res.stderr.count("error:") == 1
    assert "--start eager is not supported with --launcher mpirun [--start]" in res.stderr


def test_hydra_command_carries_hosts_counts_and_the_shared_environment():
    cmd = mpirun.build_command(_plan("node1:2,node2:2"), RDV, mpirun="mpiexec", flavour="hydra",
                               python="/venv/bin/python")
    argv = list(cmd.argv)
    assert argv[:7] == ["mpiexec", "-launcher", "ssh", "-hosts", "node1:2,node2:2", "-n", "4"]
    names = argv[argv.index("-genvlist") + 1].split(",")
    assert {"NCCL_DEBUG", "MASTER_ADDR", "WORLD_SIZE"} <= set(names)
    assert cmd.env["NCCL_DEBUG"] == "INFO" and cmd.env["MASTER_ADDR"] == "node1"
    assert "INFO" not in argv  # values travel in mpiexec's environment, not on its command line
    assert argv[-9:] == ["/venv/bin/python", "-E", "-P", "-m", "launcher.mpirun.rankshim", "--",
                         "python", "t.py", "a b"]
    assert "RANK" not in argv  # per-rank variables come from the workerenv shim
    # torchrun's job-wide variables too, so frameworks that look for torchrun find it
    assert (cmd.env["TORCHELASTIC_RUN_ID"], cmd.env["TORCHELASTIC_RESTART_COUNT"],
            cmd.env["GROUP_WORLD_SIZE"]) == ("job-1", "0", "2")


def test_the_rank_shim_derives_torchruns_role_rank_from_the_mpi_launchers_rank():
    env = workerenv.from_mpi_launcher({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1",
                                       "MPI_LOCALNRANKS": "2"})
    assert (env["RANK"], env["ROLE_RANK"], env["GROUP_RANK"]) == ("3", "3", "1")


def test_open_mpi_command_uses_a_hostfile_map_by_slot_and_x_exports():
    cmd = mpirun.build_command(_plan("alice@node1 slots=2\nnode2 slots=1\n"), RDV, mpirun="mpirun",
                               flavour="openmpi", python="/venv/bin/python")
    argv = list(cmd.argv)
    assert argv[:6] == ["mpirun", "--hostfile", "{hostfile}", "-np", "3", "--map-by"]
    assert argv[argv.index("NCCL_DEBUG") - 1] == "-x" and "WORLD_SIZE" in argv
    assert not [a for a in argv if "=" in a]  # names only: -x NAME exports mpirun's value
    assert cmd.env["NCCL_DEBUG"] == "INFO" and cmd.env["WORLD_SIZE"] == "3"
    assert cmd.hostfile_text == "alice@node1 slots=2\nnode2 slots=1\n"


def test_gpu_slot_selection_is_refused_with_mpirun():
    with pytest.raises(UsageError, match="slot selection unsupported"):
        mpirun.build_command(_plan("node1:4", include="node1:1,2"), RDV, mpirun="mpiexec",
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
                      PYTHON, "-c", "raise SystemExit(9)"], env={"HF_TOKEN": "hf_dry run"})
    assert res.returncode == 0, res.stderr
    assert "mpiexec" in res.stdout and "-hosts localhost:2" in res.stdout
    assert "HF_TOKEN='hf_dry run' " in res.stdout  # shown to its user, ready to paste


SECRET_SEEN = ("import glob, os\n"
               "secret = os.environ['HF_TOKEN'].encode()\n"
               "seen = []\n"
               "for path in glob.glob('/proc/[0-9]*/cmdline'):\n"
               "    try:\n"
               "        if secret in open(path, 'rb').read():\n"
               "            seen.append(path)\n"
               "    except OSError:\n"
               "        pass\n"
               "open(os.path.join(os.environ['REPORT_DIR'], os.environ['RANK']), 'w')"
               ".write(repr(seen))\n")


def test_a_forwarded_secret_reaches_the_ranks_but_no_command_line_under_hydra(tmp_path):
    # What `ps` shows any local user while the job runs: mpiexec, its proxies, the rank shims.
    token = f"hf_{os.urandom(12).hex()}"
    res = run_dtrain(["launch", "--launcher", "mpirun", "-H", "localhost:2", "--env",
                      f"REPORT_DIR={tmp_path}", "--", PYTHON, "-c", SECRET_SEEN],
                     env={"HF_TOKEN": token})
    assert res.returncode == 0, res.stderr
    assert [(tmp_path / r).read_text() for r in ("0", "1")] == ["[]", "[]"]


def test_hydra_is_given_the_head_address_its_proxies_connect_back_to():
    plan = _plan("node1:2,node2:2")
    cmd = mpirun.build_command(plan, RDV, mpirun="mpiexec", flavour="hydra", python="/p",
                               head_addr="10.9.8.1")
    argv = list(cmd.argv)
    assert argv[argv.index("-localhost") + 1] == "10.9.8.1"
    local = mpirun.build_command(plan, RDV, mpirun="mpiexec", flavour="hydra", python="/p")
    assert "-localhost" not in local.argv


def test_addresses_follow_the_route_from_a_multi_homed_head(netns_cluster):
    # The head has the bridge, the VM's own NIC and loopback: the hosts reach it on the bridge.
    hosts = parse_host_list(f"localhost:1,{netns_cluster.address('node1')}:1")
    where = mpirun.addresses(hosts, None)
    assert where.head_addr == netns_cluster.head_address
    assert where.master_addr == netns_cluster.head_address  # rank 0 runs on the head
    remote_first = parse_host_list(f"{netns_cluster.address('node2')}:1,localhost:1")
    assert mpirun.addresses(remote_first, None).master_addr == netns_cluster.address("node2")
    assert mpirun.addresses(parse_host_list("localhost:2"), None) == mpirun.Addresses("127.0.0.1")


def test_ranks_under_hydra_get_the_interface_that_routes_to_master_addr(tmp_path):
    code = ("import os, json; e = os.environ; "
            "open(os.path.join(e['REPORT_DIR'], e['RANK']), 'w').write(json.dumps("
            "[e.get('GLOO_SOCKET_IFNAME'), e.get('NCCL_SOCKET_IFNAME'), e['MASTER_ADDR']]))")
    res = run_dtrain(["launch", "--launcher", "mpirun", "-H", "localhost:2", "--env",
                      f"REPORT_DIR={tmp_path}", "--env", "NCCL_SOCKET_IFNAME=mine0", "--",
                      PYTHON, "-c", code])
    assert res.returncode == 0, res.stderr
    for rank in ("0", "1"):
        # loopback routes to 127.0.0.1; a variable the user set is kept.
        assert json.loads((tmp_path / rank).read_text()) == ["lo", "mine0", "127.0.0.1"]


def _recorded(pid_dir) -> list[int]:
    return [int(p) for f in pid_dir.glob("*.pid") for p in f.read_text().split()]


def test_a_rank_exiting_7_under_hydra_stops_the_others_and_the_job_exits_7(tmp_path):
    try:
        res = run_dtrain(["launch", "--launcher", "mpirun", "-H", "localhost:3", "--", PYTHON,
                          PROBE, "fail", "1", "7"], env={"PROBE_PID_DIR": str(tmp_path)},
                         timeout=60)
        assert res.returncode == 7, res.stderr
        assert len(_recorded(tmp_path)) == 3 and not wait_gone(_recorded(tmp_path), 10)
    finally:
        kill_recorded(_recorded(tmp_path))


def test_an_mpi_rank_failing_before_finalize_ends_the_hydra_job_with_its_code(tmp_path):
    code = ("from mpi4py import MPI; import os, time\n"
            "MPI.COMM_WORLD.Barrier()\n"
            "open(os.path.join(os.environ['PROBE_PID_DIR'], os.environ['RANK'] + '.pid'),"
            " 'w').write(str(os.getpid()))\n"
            "if MPI.COMM_WORLD.rank == 0:\n"
            "    time.sleep(1); os._exit(5)\n"
            "MPI.COMM_WORLD.Barrier()\n")
    try:
        res = run_dtrain(["launch", "--launcher", "mpirun", "-H", "localhost:2", "--", PYTHON,
                          "-c", code], env={"PROBE_PID_DIR": str(tmp_path)}, timeout=60)
        assert res.returncode == 5, res.stderr
        assert len(_recorded(tmp_path)) == 2 and not wait_gone(_recorded(tmp_path), 10)
    finally:
        kill_recorded(_recorded(tmp_path))


def test_sigkill_of_the_head_ends_the_hydra_job_too(tmp_path):
    head = start_dtrain(["launch", "--launcher", "mpirun", "-H", "localhost:2", "--", PYTHON,
                         PROBE, "sleep", "120"], env={"PROBE_PID_DIR": str(tmp_path)})
    try:
        for rank in (0, 1):
            wait_for_lines(tmp_path / f"{rank}.pid", 1)
        head.kill()
        head.communicate(timeout=10)
        assert not wait_gone(_recorded(tmp_path), 15)
    finally:
        head.kill()
        kill_recorded(_recorded(tmp_path))


def test_hydra_ranks_on_two_hosts_reach_a_multi_homed_head_and_form_one_world(netns_cluster,
                                                                             tmp_path):
    # Here the head's host name resolves to 127.0.0.1 (as on many machines), so Hydra's
    # proxies only find their way back through the -localhost address dtrain computes.
    config = tmp_path / "ssh_config"
    config.write_text(f"Host *\n  User root\n  IdentityFile {netns_cluster.client_key}\n"
                      f"  IdentitiesOnly yes\n  UserKnownHostsFile {netns_cluster.known_hosts}\n"
                      "  StrictHostKeyChecking yes\n  BatchMode yes\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "ssh").write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {config} \"$@\"\n")
    (bindir / "ssh").chmod(0o755)
    hosts = f"{netns_cluster.address('node1')}:1,{netns_cluster.address('node2')}:1"
    code = ("from mpi4py import MPI; import os, socket\n"
            "e = os.environ\n"
            "world = MPI.COMM_WORLD.allreduce(1)\n"
            "line = f\"{socket.gethostname()} {e['GLOO_SOCKET_IFNAME']} {world}\"\n"
            "open(os.path.join(e['REPORT_DIR'], e['RANK']), 'w').write(line)\n")
    res = run_dtrain(["launch", "--launcher", "mpirun", "-H", hosts, "--env",
                      f"REPORT_DIR={tmp_path}", "--", PYTHON, "-c", code],
                     env={"PATH": f"{bindir}:{os.environ['PATH']}"}, timeout=120)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "0").read_text() == "node1 eth0 2"
    assert (tmp_path / "1").read_text() == "node2 eth0 2"
    assert not netns_cluster.wait_no_job_pids(10)


def test_timeout_stops_a_hydra_job_with_exit_code_124(tmp_path):
    try:
        res = run_dtrain(["launch", "--launcher", "mpirun", "-H", "localhost:2", "--timeout",
                          "3", "--grace", "2", "--", PYTHON, PROBE, "sleep", "120"],
                         env={"PROBE_PID_DIR": str(tmp_path)}, timeout=60)
        assert res.returncode == 124, res.stderr
        assert "stopped by --timeout after 3s" in res.stderr
        assert len(_recorded(tmp_path)) == 2 and not wait_gone(_recorded(tmp_path), 10)
    finally:
        kill_recorded(_recorded(tmp_path))
