"""Slurm node lists, the allocation's hosts and slots, and the srun step (pure, fast).

The node-list expansion is compared with `scontrol show hostnames` itself (Debian's Slurm,
installed by `make sysdeps`; it needs a slurm.conf but no daemon).
"""

from __future__ import annotations

import shutil
import subprocess
import tracemalloc
from collections.abc import Callable

import pytest

from launcher.errors import HostfileError, UsageError
from launcher.hosts.selection import select_hosts
from launcher.slurm.allocation import read_allocation, with_gpu_ids
from launcher.slurm.nodelist import expand_counts, expand_nodelist
from launcher.slurm.srun import srun_command, srun_environment, start_agents
from tests.support import REPO, run_dtrain

AWKWARD = [
    "gpu[01-04,07],login2",            # zero padding, a range and a single, then a plain host
    "z[009-011],y[8-11]",              # padding kept, then widths that grow (8..11)
    "a[1-2]b[08-10]",                  # two bracket groups: a cartesian product
    "a[1-2][3-4]",                     # adjacent groups
    "r[1-2]-n[3,5],x,q[1-2],q[2-3]",   # text between groups; duplicates kept as Slurm keeps them
    "node1",
    "h[9-11]",
    "a[01-2]",                         # width from the low bound
    " a , b",
]


@pytest.fixture(scope="module")
def scontrol(tmp_path_factory):
    """`scontrol` with a minimal configuration (hostname expansion contacts no daemon)."""
    exe = shutil.which("scontrol")
    if exe is None:
        pytest.skip("no scontrol; run `make sysdeps` as root")
    conf = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    conf.write_text("ClusterName=probe\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\n"
                    "PartitionName=p Nodes=ALL\n")

    def hostnames(text: str) -> list[str]:
        done = subprocess.run([exe, "show", "hostnames", text], capture_output=True, text=True,
                              env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"})
        assert done.returncode == 0, done.stderr
        return done.stdout.split()
    return hostnames


@pytest.mark.parametrize("text", AWKWARD)
def test_a_node_list_expands_exactly_as_scontrol_show_hostnames(scontrol, text):
    assert expand_nodelist(text) == scontrol(text)


@pytest.mark.parametrize("text", ["n[10-8]", "a[]", "a[1,,2]", "a[1-3", "n[1-2]],x",
                                  "n[1-3]x", "n[a-b]", "", "n[1-99999999]"])
def test_a_malformed_node_list_is_one_clear_error_naming_the_variable(text):
    with pytest.raises(HostfileError, match=r"SLURM_JOB_NODELIST"):
        expand_nodelist(text)


def peak_bytes(work: Callable[[], object]) -> int:
    """The most memory Python allocated while ``work`` ran (it is expected to raise)."""
    tracemalloc.start()
    try:
        with pytest.raises(HostfileError) as info:
            work()
        assert "too long" in info.value.what or "too many" in info.value.what, info.value
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("text", [
    "a[1-300]b[1-300]",                          # a product of two small groups: 90,000 names
    "n[" + ",".join(["1-60000"] * 3) + "]",      # one group of ranges that each pass alone
    "x,a[1-256][1-256][1-2]",                    # three groups after a plain name
], ids=["product", "ranges-in-a-group", "three-groups"])
def test_a_node_list_over_the_limit_is_refused_before_its_names_are_built(text):
    # 90,000 names of ~8 characters would take several MiB; the refusal needs next to nothing.
    assert peak_bytes(lambda: expand_nodelist(text)) < 256 * 1024


def test_repeated_per_node_counts_over_the_limit_are_refused_before_they_are_built():
    assert peak_bytes(lambda: expand_counts("4(x10000000)", "SLURM_TASKS_PER_NODE")) < 256 * 1024


@pytest.mark.parametrize("text", ["n[" + "9" * 5000 + "]", "n[1-" + "9" * 5000 + "]"])
def test_a_number_too_long_for_a_node_name_is_one_error_not_a_traceback(text):
    with pytest.raises(HostfileError, match="SLURM_JOB_NODELIST"):
        expand_nodelist(text)
    with pytest.raises(HostfileError, match="SLURM_TASKS_PER_NODE"):
        expand_counts("9" * 5000, "SLURM_TASKS_PER_NODE")


def test_per_node_counts_expand_their_repetitions():
    assert expand_counts("4(x2),2", "SLURM_TASKS_PER_NODE") == [4, 4, 2]
    with pytest.raises(HostfileError, match=r"SLURM_TASKS_PER_NODE.*4\(x2\),2"):
        expand_counts("4(2)", "SLURM_TASKS_PER_NODE")


def _alloc(**env: str):
    return read_allocation({"SLURM_JOB_ID": "42", **env})


def test_gpus_on_node_give_every_node_its_slots_and_say_so():
    alloc = _alloc(SLURM_JOB_NODELIST="gpu[01-02],login2", SLURM_GPUS_ON_NODE="4",
                   SLURM_NTASKS_PER_NODE="1")
    assert [(e.name, e.slots) for e in alloc.entries] == [("gpu01", 4), ("gpu02", 4),
                                                          ("login2", 4)]
    assert "SLURM_JOB_NODELIST=gpu[01-02],login2" in alloc.entries[0].source
    assert "SLURM_GPUS_ON_NODE=4" in alloc.entries[0].source


def test_task_counts_per_node_are_the_slots_without_gpus():
    alloc = _alloc(SLURM_NODELIST="n[1-3]", SLURM_TASKS_PER_NODE="2(x2),1")
    assert [e.slots for e in alloc.entries] == [2, 2, 1]
    assert "SLURM_TASKS_PER_NODE=2(x2),1" in alloc.entries[2].source
    with pytest.raises(HostfileError, match="3 nodes"):
        _alloc(SLURM_NODELIST="n[1-3]", SLURM_TASKS_PER_NODE="2")
    assert [e.slots for e in _alloc(SLURM_NODELIST="n1", SLURM_NTASKS_PER_NODE="3").entries] \
        == [3]


def test_job_gpu_ids_are_the_physical_devices_of_the_head_node_only():
    alloc = _alloc(SLURM_JOB_NODELIST="gpu[01-02]", SLURM_GPUS_ON_NODE="2",
                   SLURM_JOB_GPUS="2,5", SLURMD_NODENAME="gpu01")
    chosen = with_gpu_ids(select_hosts(list(alloc.entries)), alloc)
    assert [(h.entry.name, h.slots, h.restricted) for h in chosen] == [
        ("gpu01", (2, 5), True), ("gpu02", (0, 1), False)]
    # --include slot 1 of gpu01 is the allocation's second GPU there: physical id 5
    one = with_gpu_ids(select_hosts(list(alloc.entries), include="gpu01:1"), alloc)
    assert [(h.entry.name, h.slots) for h in one] == [("gpu01", (5,))]


def test_under_constrained_devices_the_head_nodes_gpus_are_numbered_as_the_job_sees_them():
    # ConstrainDevices: physical GPUs 2,5 are CUDA devices 0,1 inside the job's cgroup.
    alloc = _alloc(SLURM_JOB_NODELIST="gpu01", SLURM_GPUS_ON_NODE="2", SLURM_JOB_GPUS="2,5",
                   SLURMD_NODENAME="gpu01", CUDA_VISIBLE_DEVICES="0,1")
    chosen = with_gpu_ids(select_hosts(list(alloc.entries), include="gpu01:1"), alloc)
    assert [(h.entry.name, h.slots) for h in chosen] == [("gpu01", (1,))]
    assert "CUDA_VISIBLE_DEVICES=0,1 (physical SLURM_JOB_GPUS=2,5)" in alloc.entries[0].source
    # a CUDA_VISIBLE_DEVICES that is not Slurm's list of the job's GPUs is not used
    for stray in ("0", "GPU-5d2c,GPU-77aa", ""):
        other = _alloc(SLURM_JOB_NODELIST="gpu01", SLURM_JOB_GPUS="2,5",
                       SLURMD_NODENAME="gpu01", CUDA_VISIBLE_DEVICES=stray)
        assert other.gpu_ids == {"gpu01": (2, 5)}, stray


def test_the_dry_run_inside_an_allocation_shows_hosts_slots_and_their_source(tmp_path):
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_GPUS_ON_NODE": "2",
           "SLURM_JOB_GPUS": "1,3", "SLURMD_NODENAME": "gpu07"}
    res = run_dtrain(["launch", "--dry-run", "--", "python", "x.py"], env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "4 ranks on 2 hosts" in res.stdout
    rows = [line for line in res.stdout.splitlines() if "gpu0" in line and "│" in line]
    assert "1,3" in rows[0] and "SLURM_JOB_GPUS" in rows[0]
    assert "Slurm job 9 SLURM_JOB_NODELIST=gpu[07-08]" in rows[1]
    assert "SLURM_GPUS_ON_NODE=2" in rows[1]
    assert "CUDA_VISIBLE_DEVICES=1,3" in res.stdout


def test_outside_an_allocation_nothing_changes(tmp_path):
    res = run_dtrain(["launch", "--dry-run", "--", "python", "x.py"], cwd=tmp_path,
                     env={"SLURM_JOB_ID": "", "SLURM_JOB_NODELIST": "gpu[07-08]"})
    assert res.returncode == 0, res.stderr
    assert "1 rank on 1 host" in res.stdout and "localhost" in res.stdout
    stray = run_dtrain(["launch", "--dry-run", "--", "python", "x.py"], cwd=tmp_path,
                       env={"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "", "SLURM_NODELIST": ""})
    assert stray.returncode == 0 and "localhost" in stray.stdout, stray.stderr


def test_the_srun_step_is_a_constant_command_and_srun_reads_no_inherited_options():
    argv = srun_command("gpu01", "42", "/opt/py/bin/python", "/usr/bin/srun")
    assert argv[-6:] == ["/opt/py/bin/python", "-E", "-P", "-u", "-m", "launcher.agent"]
    assert "--nodelist=gpu01" in argv and "--jobid=42" in argv and "--unbuffered" in argv
    env = srun_environment({"SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_ID": "42",
                            "SLURM_CONF": "/etc/slurm.conf", "PATH": "/bin"})
    assert env == {"SLURM_CONF": "/etc/slurm.conf", "PATH": "/bin"}


def test_launcher_slurm_outside_an_allocation_is_one_clear_error():
    with pytest.raises(UsageError, match=r"needs a Slurm allocation.*SLURM_JOB_ID is not set"):
        start_agents([], python="/usr/bin/python3", environ={"PATH": "/usr/bin"})
    res = run_dtrain(["launch", "--launcher", "slurm", "--", "true"], cwd=REPO,
                     env={"SLURM_JOB_ID": ""})
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("needs a Slurm allocation") == 1
