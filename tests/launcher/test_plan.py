"""Rank placement, the per-rank contract environment and PMI_process_mapping."""

from __future__ import annotations

import io
import re

import pytest

import workerenv as we
from launcher.dryrun import print_plan, program_column
from launcher.errors import UsageError
from launcher.hosts.hostfile import parse_hostfile_text
from launcher.hosts.selection import select_hosts
from launcher.plan.job import JobPlan, Rendezvous, RoundInfo, make_plan, new_job_id, process_mapping

HOSTS = parse_hostfile_text("node1 slots=2\nnode2 slots=2\nnode3 slots=1\n", "hf")


def plan_for(selected=None, **overrides) -> JobPlan:
    options = {"argv": ["python", "train.py"], "cwd": "/work", "job_id": "job-1",
               "base_env": {}}
    options.update(overrides)
    return make_plan(select_hosts(HOSTS) if selected is None else selected, **options)


def rankmap(mapping: str, size: int) -> list[int]:
    """rank -> node id, read the way MPICH's MPL_rankmap_str_to_array reads a block list."""
    body = re.fullmatch(r"\(vector,(.*)\)", mapping).group(1)
    out: list[int] = []
    for start, nodes, per in re.findall(r"\((\d+),(\d+),(\d+)\)", body):
        for node in range(int(start), int(start) + int(nodes)):
            out += [node] * int(per)
    assert re.sub(r"\(\d+,\d+,\d+\)", "", body).strip(",") == ""  # nothing but triples
    return out[:size]


# --- placement -----------------------------------------------------------------------------

def test_ranks_fill_host_by_host_in_hostfile_order():
    plan = plan_for()
    placed = [(r.rank, r.host, r.node_rank, r.local_rank) for r in plan.ranks]
    assert placed == [(0, "node1", 0, 0), (1, "node1", 0, 1), (2, "node2", 1, 0),
                      (3, "node2", 1, 1), (4, "node3", 2, 0)]
    assert plan.world_size == 5


def test_rank_env_holds_the_whole_contract_once_the_rendezvous_is_known():
    plan = plan_for(job_id="j7")
    assert we.MASTER_ADDR not in plan.rank_env(plan.ranks[3])  # decided at start-up
    env = plan.rank_env(plan.ranks[3], Rendezvous("node1", 29500))
    assert env == {
        we.RANK: "3", we.WORLD_SIZE: "5", we.LOCAL_RANK: "1", we.LOCAL_WORLD_SIZE: "2",
        we.GROUP_RANK: "1", we.NODE_RANK: "1", we.MASTER_ADDR: "node1",
        we.MASTER_PORT: "29500", we.JOB_ID: "j7", we.HOST: "node2", we.PMI_RANK: "3",
        we.PMI_SIZE: "5", we.OMP_NUM_THREADS: "1", we.RESTART_COUNT: "0",
        # what torchrun adds (torch/distributed/elastic/agent/server/local_elastic_agent.py)
        we.TORCHELASTIC_RUN_ID: "j7", we.TORCHELASTIC_RESTART_COUNT: "0",
        we.TORCHELASTIC_MAX_RESTARTS: "0", we.TORCHELASTIC_USE_AGENT_STORE: "False",
        we.ROLE_RANK: "3", we.ROLE_NAME: "default", we.ROLE_WORLD_SIZE: "5",
        we.GROUP_WORLD_SIZE: "3", we.TORCH_NCCL_ASYNC_ERROR_HANDLING: "1"}


def test_the_restart_count_is_the_plans_and_reaches_every_rank():
    plan = plan_for(restart=RoundInfo(number=2, max_restarts=3, cause="rank 1 exited 1",
                                      initial_world=5))
    for spec in plan.ranks:
        env = plan.rank_env(spec)
        assert (env[we.RESTART_COUNT], env[we.TORCHELASTIC_RESTART_COUNT],
                env[we.TORCHELASTIC_MAX_RESTARTS]) == ("2", "2", "3")
    assert plan.job_env()[we.TORCHELASTIC_RESTART_COUNT] == "2"  # --launcher mpirun's too


def test_a_users_nccl_error_handling_wins_over_torchruns_default():
    plan = plan_for(base_env={we.TORCH_NCCL_ASYNC_ERROR_HANDLING: "3"})
    assert plan.rank_env(plan.ranks[0])[we.TORCH_NCCL_ASYNC_ERROR_HANDLING] == "3"


def test_worker_contract_reads_back_what_the_plan_wrote():
    plan = plan_for()
    worker = we.WorkerEnv.from_environ(plan.rank_env(plan.ranks[4], Rendezvous("node1", 29500)))
    assert (worker.rank, worker.world_size, worker.local_rank, worker.local_world_size,
            worker.node_rank, worker.host) == (4, 5, 0, 1, 2, "node3")


def test_pmi_fd_and_port_are_left_to_the_agent():
    env = plan_for().rank_env(plan_for().ranks[0])
    assert we.PMI_FD not in env and we.PMI_PORT not in env and we.PMI_ID not in env


def test_base_env_reaches_every_rank_and_the_contract_wins_over_it():
    plan = plan_for(base_env={"NCCL_DEBUG": "INFO", we.RANK: "99"})
    for spec in plan.ranks:
        env = plan.rank_env(spec)
        assert env["NCCL_DEBUG"] == "INFO" and env[we.RANK] == str(spec.rank)


def test_user_omp_num_threads_is_kept():
    plan = plan_for(base_env={we.OMP_NUM_THREADS: "8"})
    assert plan.rank_env(plan.ranks[0])[we.OMP_NUM_THREADS] == "8"


def test_unrestricted_hosts_get_no_cuda_visible_devices():
    plan = plan_for()
    assert all(h.cuda_visible_devices is None for h in plan.hosts)
    assert we.CUDA_VISIBLE_DEVICES not in plan.rank_env(plan.ranks[0])


def test_selected_gpus_become_cuda_visible_devices_and_local_rank_indexes_them():
    hosts = parse_hostfile_text("node1 slots=4\nnode2 slots=4\n", "hf")
    plan = plan_for(select_hosts(hosts, include="node1:1,3@node2"))
    first = plan.hosts[0]
    assert first.cuda_visible_devices == "1,3" and plan.hosts[1].cuda_visible_devices is None
    envs = [plan.rank_env(r) for r in first.ranks]
    assert [(e[we.LOCAL_RANK], e[we.CUDA_VISIBLE_DEVICES]) for e in envs] == [
        ("0", "1,3"), ("1", "1,3")]
    assert plan.world_size == 6


def test_plan_is_immutable():
    plan = plan_for()
    with pytest.raises(TypeError):
        plan.base_env["X"] = "1"  # type: ignore[index]
    with pytest.raises(TypeError):
        plan.ranks[0].env["RANK"] = "7"  # type: ignore[index]


def test_plan_keeps_argv_and_cwd():
    plan = plan_for(argv=["python", "-c", "print('a b; $x')"])
    assert plan.argv == ("python", "-c", "print('a b; $x')") and plan.cwd == "/work"


# --- refusals ------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, where", [
    ({"argv": []}, "launch"),
    ({"argv": ["python", "a\0b"]}, "argv[1]"),
    ({"cwd": "relative/dir"}, "cwd"),
    ({"job_id": "bad id"}, "job id"),
    ({"job_id": "../x"}, "job id"),
    ({"base_env": {"BAD NAME": "1"}}, "BAD NAME"),
    ({"base_env": {"X": "a\0b"}}, "X"),
])
def test_bad_plan_inputs_are_refused_naming_the_input(overrides, where):
    with pytest.raises(UsageError) as info:
        plan_for(**overrides)
    assert info.value.where == where


def test_empty_selection_is_refused():
    with pytest.raises(UsageError, match="nothing to run on"):
        plan_for(selected=[])


# --- job id --------------------------------------------------------------------------------

def test_new_job_ids_are_unique_plain_and_accepted_by_the_plan():
    ids = {new_job_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", i) for i in ids)
    assert plan_for(job_id=ids.pop()).job_id


# --- PMI_process_mapping -------------------------------------------------------------------

def test_homogeneous_mapping_is_one_block():
    assert process_mapping([8, 8]) == "(vector,(0,2,8))"


def test_single_host_mapping():
    assert process_mapping([4]) == "(vector,(0,1,4))"


def test_heterogeneous_mapping_has_one_block_per_run_of_equal_counts():
    assert process_mapping([2, 2, 1]) == "(vector,(0,2,2),(2,1,1))"
    assert process_mapping([2, 2, 4, 4]) == "(vector,(0,2,2),(2,2,4))"


def test_alternating_counts_give_a_block_per_host():
    assert process_mapping([1, 2, 1]) == "(vector,(0,1,1),(1,1,2),(2,1,1))"


@pytest.mark.parametrize("counts", [[3], [2, 2, 1], [1, 3, 3, 2, 2, 2], [4] * 9])
def test_mapping_reads_back_as_the_block_placement(counts):
    expected = [node for node, n in enumerate(counts) for _ in range(n)]
    assert rankmap(process_mapping(counts), sum(counts)) == expected


def test_plan_mapping_matches_its_rank_placement():
    plan = plan_for()
    assert plan.process_mapping == "(vector,(0,2,2),(2,1,1))"
    assert rankmap(plan.process_mapping, plan.world_size) == [r.node_rank for r in plan.ranks]


@pytest.mark.parametrize("counts", [[], [0], [2, -1]])
def test_mapping_rejects_empty_or_non_positive_counts(counts):
    with pytest.raises(ValueError):
        process_mapping(counts)


# --- dry run: which executable each host runs ------------------------------------------------

def test_dry_run_shows_the_executable_each_host_will_run(tmp_path):
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    python = venv_bin / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    hosts = select_hosts(parse_hostfile_text("localhost slots=1\nnode1 slots=1\n", "hf"))
    path = f"{venv_bin}:/usr/bin"
    plan = plan_for(hosts, cwd=str(tmp_path), base_env={"PATH": path})
    head = {"PATH": "/usr/bin"}
    local, remote = (program_column(plan, hp.entry, head) for hp in plan.hosts)
    assert local == str(python)
    assert remote == f"{python} if present there, else the host's PATH"
    elsewhere = plan_for(hosts, cwd=str(tmp_path), base_env={"PATH": "/nonexistent"})
    assert program_column(elsewhere, elsewhere.hosts[1].entry, head) == "the host's PATH"
    absolute = plan_for(hosts, cwd=str(tmp_path), argv=[str(python)])
    assert program_column(absolute, absolute.hosts[1].entry, head) == str(python)
    out = io.StringIO()
    print_plan(plan, master=("node1", 29500), out=out, head_environ=head)
    assert f"{python} if present there" in out.getvalue()
    assert "`dtrain check` shows which `python` each host runs" in out.getvalue()


@pytest.mark.parametrize("addr, port, where", [
    ("", 29500, "MASTER_ADDR"), ("a b", 29500, "MASTER_ADDR"),
    ("node1", 0, "MASTER_PORT"), ("node1", 70000, "MASTER_PORT")])
def test_a_bad_rendezvous_is_refused_naming_the_variable(addr, port, where):
    with pytest.raises(UsageError) as info:
        Rendezvous(addr, port)
    assert info.value.where == where
