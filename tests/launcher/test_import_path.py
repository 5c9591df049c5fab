"""dtrain's own processes (the agent on every transport, the mpirun rank shim) never import
from their working directory, whatever it holds: a `launcher/` package and a `workerenv.py`
planted in the launch directory (or in the directory a remote login starts in) stay unused.

The head runs as the `dtrain` console script, as a user starts it. The Slurm case is in
`test_slurm_cluster.py` (its fixture).
"""

from __future__ import annotations

import subprocess

import pytest

from testbed.sshd import SshdServer
from tests.support import (
    DTRAIN_SCRIPT,
    PYTHON,
    dtrain_env,
    imposters_imported,
    plant_imposters,
)

HELLO = "import os; print('hello from rank', os.environ['RANK'])"
AGENT_CWD = "import os; print('agent in', os.readlink(f'/proc/{os.getppid()}/cwd'))"


def dtrain(args: list[str], cwd, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DTRAIN_SCRIPT, *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=dtrain_env(env))


def test_a_launcher_package_and_workerenv_in_the_launch_directory_never_run_in_the_agent(
        tmp_path):
    shared = plant_imposters(tmp_path)
    res = dtrain(["launch", "--nproc-per-node", "2", "--", PYTHON, "-c", HELLO], shared)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("hello from rank") == 2
    assert imposters_imported(shared) == []


def test_the_mpirun_rank_shim_never_imports_from_the_launch_directory(tmp_path):
    shared = plant_imposters(tmp_path)
    res = dtrain(["launch", "--launcher", "mpirun", "-H", "localhost:2", "--", PYTHON, "-c",
                  HELLO], shared)
    assert res.returncode == 0, res.stderr
    assert imposters_imported(shared) == []


def test_an_empty_pythonpath_entry_does_not_bring_the_working_directory_back(tmp_path):
    # `export PYTHONPATH=$PYTHONPATH:/x` with PYTHONPATH unset gives ":/x": its empty entry is
    # the working directory, here the --chdir folder Hydra starts each rank shim in.
    shared = plant_imposters(tmp_path / "shared")
    head_dir = tmp_path / "head"
    head_dir.mkdir()
    res = dtrain(["launch", "--launcher", "mpirun", "-H", "localhost:2", "--chdir", str(shared),
                  "--", PYTHON, "-c", HELLO], head_dir, {"PYTHONPATH": ":/nonexistent"})
    assert res.returncode == 0, res.stderr
    assert imposters_imported(shared) == []


@pytest.fixture
def login_in_shared_directory(tmp_path):
    """An sshd whose logins start in a folder holding the imposters (a site's shell profile
    that changes to a shared scratch directory)."""
    shared = plant_imposters(tmp_path / "scratch")
    server = SshdServer(extra_config=f'ForceCommand cd {shared} && exec /bin/sh -c '
                                     f'"$SSH_ORIGINAL_COMMAND"\n')
    yield server, shared
    server.close()


@pytest.mark.parametrize("client", ["paramiko", "openssh"])
def test_a_remote_agent_never_imports_from_the_directory_its_login_starts_in(
        login_in_shared_directory, client, tmp_path):
    server, shared = login_in_shared_directory
    res = dtrain(["launch", "-H", "loopback:1", "--ssh-config", str(server.ssh_config),
                  "--ssh-client", client, "--", PYTHON, "-c", AGENT_CWD], tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"agent in {shared}" in res.stdout  # the login did start it there
    assert imposters_imported(shared) == []
