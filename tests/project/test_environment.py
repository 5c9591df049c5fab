"""Forwarded prefixes, scrubbing, .dtrainenv files, --env and their composition order."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from launcher.errors import EnvironmentFileError, UsageError
from launcher.plan.environment import (
    compose_base_env,
    default_env_files,
    forwarded_env,
    merge_path,
    parse_env_assignments,
    rank_environment,
    read_env_file,
    scrub,
)
from tests.support import PYTHON, run_dtrain


def env_file(directory: Path, content: str | bytes, name: str = ".dtrainenv",
             mode: int = 0o644) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    path.chmod(mode)  # whatever the umask: only the owner may write an env file
    return path


def file_error(tmp_path: Path, content: str | bytes) -> EnvironmentFileError:
    path = env_file(tmp_path, content)
    with pytest.raises(EnvironmentFileError) as info:
        read_env_file(path)
    return info.value


# --- forwarding and scrubbing --------------------------------------------------------------

def test_only_allow_listed_prefixes_are_forwarded():
    head = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/src", "HOME": "/root", "LD_PRELOAD": "x.so",
            "AWS_SECRET_ACCESS_KEY": "s", "TORCH_LOGS": "+dynamo", "OMP_NUM_THREADS": "4"}
    assert forwarded_env(head) == {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/src",
                                   "TORCH_LOGS": "+dynamo", "OMP_NUM_THREADS": "4"}


def test_the_settings_frameworks_read_from_the_environment_are_forwarded():
    """DeepSpeed, Accelerate, Lightning, Megatron-core / Transformer Engine, torch.compile and
    Hugging Face read these (workerenv's FORWARDED_PREFIXES); torchrun's own are the plan's."""
    head = {"DS_ACCELERATOR": "cpu", "DS_SKIP_CUDA_CHECK": "1", "ACCELERATE_MIXED_PRECISION": "no",
            "FSDP_OFFLOAD_PARAMS": "false", "MEGATRON_LM_TP_DEGREE": "2",
            "PARALLELISM_CONFIG_TP_SIZE": "2", "PL_GLOBAL_SEED": "7", "NVTE_FLASH_ATTN": "0",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NVIDIA_TF32_OVERRIDE": "0",
            "TORCHINDUCTOR_CACHE_DIR": "/c", "TORCHDYNAMO_VERBOSE": "1", "TRITON_CACHE_DIR": "/t",
            "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    outside = {"TORCHELASTIC_RUN_ID": "other", "ROLE_RANK": "5", "DSX": "no", "ACCELERATOR": "x"}
    assert forwarded_env({**head, **outside}) == head


@pytest.mark.parametrize("name", ["TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                                  "TORCHELASTIC_USE_AGENT_STORE", "ROLE_RANK",
                                  "GROUP_WORLD_SIZE"])
def test_env_assignment_of_a_torchrun_variable_the_plan_sets_is_a_usage_error(name):
    with pytest.raises(UsageError, match="set per rank"):
        parse_env_assignments([f"{name}=1"])


def test_the_head_interpreter_variables_are_forwarded_by_name():
    head = {"PATH": "/venv/bin:/usr/bin", "VIRTUAL_ENV": "/venv", "CONDA_PREFIX": "/c",
            "CONDA_DEFAULT_ENV": "base", "PATHOLOGY": "no", "MANPATH": "/man", "HOME": "/root"}
    assert forwarded_env(head) == {"PATH": "/venv/bin:/usr/bin", "VIRTUAL_ENV": "/venv",
                                   "CONDA_PREFIX": "/c", "CONDA_DEFAULT_ENV": "base"}


def test_merged_path_keeps_the_head_entries_first_then_the_host_only_ones():
    assert merge_path("/venv/bin:/usr/bin", "/usr/local/bin:/usr/bin:/opt/site/bin") == (
        "/venv/bin:/usr/bin:/usr/local/bin:/opt/site/bin")
    assert merge_path("/a:/a", "/a") == "/a"


def test_rank_environment_puts_the_planned_path_in_front_of_the_hosts():
    host = {"PATH": "/usr/bin:/opt/site/bin", "HOME": "/home/u", "PMI_FD": "9", "VIRTUAL_ENV": ""}
    planned = {"PATH": "/venv/bin:/usr/bin", "VIRTUAL_ENV": "/venv", "RANK": "0"}
    assert rank_environment(host, planned) == {
        "PATH": "/venv/bin:/usr/bin:/opt/site/bin", "HOME": "/home/u", "VIRTUAL_ENV": "/venv",
        "RANK": "0"}
    assert rank_environment(host, {"RANK": "1"})["PATH"] == "/usr/bin:/opt/site/bin"
    assert rank_environment({}, planned)["PATH"] == "/venv/bin:/usr/bin"


def test_forwarding_uses_the_prefixes_given():
    assert forwarded_env({"A_X": "1", "B_X": "2"}, prefixes=("A_",)) == {"A_X": "1"}


def test_head_cuda_visible_devices_is_not_forwarded():
    assert forwarded_env({"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_HOME": "/cuda"}) == {
        "CUDA_HOME": "/cuda"}


def test_scrubbed_prefixes_are_never_forwarded_even_when_allow_listed():
    head = {"PMI_RANK": "3", "PMIX_NAMESPACE": "x", "OMPI_COMM_WORLD_RANK": "1",
            "SLURM_JOB_ID": "7", "NCCL_IB_HCA": "mlx5"}
    assert forwarded_env(head, prefixes=("PMI", "OMPI_", "SLURM_", "NCCL_")) == {
        "NCCL_IB_HCA": "mlx5"}


def test_scrub_drops_other_launchers_variables_only():
    environ = {"PMI_FD": "3", "PMIX_RANK": "0", "OMPI_X": "1", "SLURM_Y": "2", "PATH": "/bin",
               "PMIFOO": "kept"}
    assert scrub(environ) == {"PATH": "/bin", "PMIFOO": "kept"}


# --- .dtrainenv ----------------------------------------------------------------------------

def test_env_file_reads_plain_export_and_quoted_values(tmp_path):
    lines = ["# comment", "", "A=1", "export B=two words", "export\tC='single $HOME \\n'",
             'D="x \\"y\\" \\\\ \\n\\t"', "E=", "F=a#b",
             "G=value # trailing comment", "H='quoted' # comment", "I=a=b=c", ""]
    path = env_file(tmp_path, "\n".join(lines))
    assert read_env_file(path) == {
        "A": "1", "B": "two words", "C": "single $HOME \\n", "D": 'x "y" \\ \n\t', "E": "",
        "F": "a#b", "G": "value", "H": "quoted", "I": "a=b=c"}


def test_env_file_later_lines_win(tmp_path):
    assert read_env_file(env_file(tmp_path, "A=1\nA=2\n")) == {"A": "2"}


def test_env_file_accepts_crlf(tmp_path):
    assert read_env_file(env_file(tmp_path, "A=1\r\nB='x'\r\n")) == {"A": "1", "B": "x"}


def test_env_file_values_keep_shell_metacharacters_literally(tmp_path):
    path = env_file(tmp_path, "X='; rm -rf ~ $(id) `id`'\n")
    assert read_env_file(path) == {"X": "; rm -rf ~ $(id) `id`"}


@pytest.mark.parametrize("line, what", [
    ("JUSTANAME", "malformed line"),
    ("1A=x", "bad variable name"),
    ("A B=x", "bad variable name"),
    ("A =x", "bad variable name"),
    ("A-B=x", "bad variable name"),
    ("A='open", "unterminated quote"),
    ('A="open', "unterminated quote"),
    ('A="x" junk', "text after a quoted value"),
    ("A=x\0y", "NUL in value"),
    ("PMI_RANK=3", "variable of another launcher"),
    ("export SLURM_JOB_ID=3", "variable of another launcher"),
    ("RANK=0", "launcher variable"),
    ("MASTER_ADDR=x", "launcher variable"),
])
def test_malformed_env_file_lines_are_refused_with_file_and_line(tmp_path, line, what):
    err = file_error(tmp_path, f"OK=1\n# note\n{line}\n")
    assert err.what == what and err.where == f"{tmp_path / '.dtrainenv'}:3"


def test_env_file_errors_do_not_echo_values(tmp_path):
    err = file_error(tmp_path, 'TOKEN="s3cret\n')
    assert "s3cret" not in str(err)


def test_non_utf8_env_file_is_refused_with_the_line(tmp_path):
    err = file_error(tmp_path, b"A=1\nB=\xff\n")
    assert err.where.endswith(":2") and "UTF-8" in err.what


def test_missing_env_file_is_refused_naming_it(tmp_path):
    with pytest.raises(EnvironmentFileError) as info:
        read_env_file(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(info.value)


# --- --env ---------------------------------------------------------------------------------

def test_env_assignments_take_values_verbatim_and_later_ones_win():
    assert parse_env_assignments(["A=1", "B=", "C=x=y", "A=3", "D= sp ace "]) == {
        "A": "3", "B": "", "C": "x=y", "D": " sp ace "}


def test_env_assignment_without_equals_is_refused_naming_it():
    with pytest.raises(EnvironmentFileError) as info:
        parse_env_assignments(["A=1", "NOVALUE"])
    assert info.value.where == "--env NOVALUE"


def test_env_assignment_with_bad_name_is_refused_by_position():
    with pytest.raises(EnvironmentFileError) as info:
        parse_env_assignments(["A=1", "B C=2"])
    assert info.value.where == "--env item 2"


def test_env_assignment_with_nul_is_refused_without_echoing_the_value():
    with pytest.raises(EnvironmentFileError) as info:
        parse_env_assignments(["TOKEN=se\0cret"])
    assert info.value.where == "--env TOKEN" and "cret" not in str(info.value)


@pytest.mark.parametrize("item", ["PMI_X=1", "PMIX_RANK=0", "OMPI_MCA_x=1", "SLURM_NODEID=0"])
def test_env_assignment_of_a_scrubbed_prefix_is_a_usage_error_saying_why(item):
    with pytest.raises(UsageError) as info:
        parse_env_assignments([item])
    assert "another launcher" in info.value.what and "MPICH" in info.value.why


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                  "DTRAIN_JOB_ID", "NODE_RANK"])
def test_env_assignment_of_a_contract_variable_is_a_usage_error(name):
    with pytest.raises(UsageError, match="set per rank"):
        parse_env_assignments([f"{name}=1"])


def test_env_assignment_may_set_cuda_visible_devices_and_omp_threads():
    assert parse_env_assignments(["CUDA_VISIBLE_DEVICES=1", "OMP_NUM_THREADS=4"]) == {
        "CUDA_VISIBLE_DEVICES": "1", "OMP_NUM_THREADS": "4"}


def test_env_assignment_errors_name_the_option_given():
    with pytest.raises(EnvironmentFileError) as info:
        parse_env_assignments(["X"], where="-x")
    assert info.value.where == "-x X"


# --- composition ---------------------------------------------------------------------------

def test_compose_order_is_forwarded_then_home_file_then_cwd_file_then_cli(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "job"
    env_file(home, "NCCL_A=home\nH=home\nBOTH=home\n")
    env_file(cwd, "BOTH=cwd\nC=cwd\nNCCL_B=cwd\n")
    head = {"HOME": str(home), "NCCL_A": "head", "NCCL_B": "head", "NCCL_C": "head"}
    env = compose_base_env(head, cwd=str(cwd), cli_env=["C=cli"])
    assert env == {"NCCL_A": "home", "NCCL_B": "cwd", "NCCL_C": "head", "H": "home",
                   "BOTH": "cwd", "C": "cli"}


def test_compose_without_env_files_is_forwarded_plus_cli(tmp_path):
    head = {"HOME": str(tmp_path / "none"), "PYTHONPATH": "/p", "SECRET": "x"}
    assert compose_base_env(head, cwd=str(tmp_path), cli_env=["A=1"]) == {
        "PYTHONPATH": "/p", "A": "1"}


def test_compose_reads_a_shared_home_and_cwd_file_once(tmp_path):
    env_file(tmp_path, "A=1\n")
    head = {"HOME": str(tmp_path)}
    assert default_env_files(head, str(tmp_path)) == [tmp_path / ".dtrainenv"]
    assert compose_base_env(head, cwd=str(tmp_path)) == {"A": "1"}


def test_compose_with_explicit_files_reads_only_those(tmp_path):
    env_file(tmp_path, "A=default\n")
    extra = env_file(tmp_path, "B=extra\n", name="extra.env")
    head = {"HOME": str(tmp_path)}
    assert compose_base_env(head, cwd=str(tmp_path), env_files=[extra]) == {"B": "extra"}
    assert compose_base_env(head, cwd=str(tmp_path), env_files=[]) == {}


def test_compose_drops_inherited_pmi_variables_but_refuses_them_on_the_command_line(tmp_path):
    head = {"HOME": str(tmp_path), "PMI_FD": "5", "PMIX_RANK": "0", "NCCL_X": "1"}
    assert compose_base_env(head, cwd=str(tmp_path)) == {"NCCL_X": "1"}
    with pytest.raises(UsageError):
        compose_base_env(head, cwd=str(tmp_path), cli_env=["PMI_FD=5"])


def test_compose_reports_a_bad_cwd_file_with_its_line(tmp_path):
    env_file(tmp_path, "A=1\nbroken line\n")
    with pytest.raises(EnvironmentFileError) as info:
        compose_base_env({"HOME": str(tmp_path / "h")}, cwd=str(tmp_path))
    assert info.value.where == f"{tmp_path / '.dtrainenv'}:2"


# --- who may write an env file ----------------------------------------------------------------

@pytest.mark.parametrize("mode,who", [(0o664, "its group"), (0o646, "every user"),
                                      (0o666, "its group and every user")],
                         ids=["group", "others", "both"])
def test_an_env_file_that_others_can_write_is_refused_naming_who_and_the_fix(tmp_path, mode, who):
    path = env_file(tmp_path, "A=1\n", mode=mode)
    with pytest.raises(EnvironmentFileError) as info:
        compose_base_env({"HOME": str(tmp_path / "h")}, cwd=str(tmp_path))
    error = info.value
    assert (error.what, error.where) == ("environment file refused", str(path))
    assert error.why.startswith(f"{who} can write it") and f"chmod go-w {path}" in error.fix


def test_an_env_file_that_is_a_fifo_is_refused_at_once_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / ".dtrainenv").symlink_to(tmp_path / "pipe")
    with pytest.raises(EnvironmentFileError, match="not a regular file"):
        compose_base_env({"HOME": str(tmp_path / "h")}, cwd=str(tmp_path),
                         env_files=[tmp_path / ".dtrainenv"])


NOBODY = 65534
SHOW_PLANTED = "import os; print('planted =', os.environ.get('PLANTED'))"


@pytest.fixture
def shared_directory():
    """A world-writable, sticky directory any local user can write to, as /tmp is."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as a second user")
    folder = Path(tempfile.mkdtemp(prefix="dtrain-shared-"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder)


def test_a_dtrainenv_another_user_planted_in_a_shared_directory_is_refused_and_nothing_runs(
        shared_directory):
    # The other user writes it, as `nobody`; we then launch from that directory.
    planted = shared_directory / ".dtrainenv"
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
                    "tee", str(planted)], input="PLANTED=yes\nLD_PRELOAD=/x.so\n", text=True,
                   check=True, stdout=subprocess.DEVNULL)
    assert planted.stat().st_uid == NOBODY
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--", PYTHON, "-c", SHOW_PLANTED],
                     cwd=shared_directory)
    assert res.returncode == 2, res.stdout + res.stderr
    [error] = res.stderr.splitlines()
    assert error.startswith(f"dtrain: error: environment file refused [{planted}]: it belongs "
                            f"to user nobody (uid {NOBODY}), not to you")
    assert "planted" not in res.stdout  # no rank started
    assert sorted(p.name for p in shared_directory.iterdir()) == [".dtrainenv"]


def test_the_head_says_once_how_many_variables_each_env_file_gave(tmp_path):
    home, job = tmp_path / "home", tmp_path / "job"
    env_file(home, "A=1\nB=2\n")
    env_file(job, "PLANTED=mine\n")
    res = run_dtrain(["launch", "--nproc-per-node", "2", "--", PYTHON, "-c", SHOW_PLANTED],
                     cwd=job, env={"HOME": str(home)})
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("planted = mine") == 2
    line = (f"dtrain: environment files: 2 variables from {home / '.dtrainenv'}, "
            f"1 variable from {job / '.dtrainenv'}\n")
    assert res.stderr.count(line) == 1, res.stderr
