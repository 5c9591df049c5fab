"""--ssh-client openssh: agents over the system `ssh` client, against a real sshd on loopback.

The launches across the namespace cluster run in `test_launch_cluster.py` (parametrized over
the client); the config refusals in `test_ssh_config_refusal.py`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launcher.hosts.hostfile import HostEntry
from launcher.transport.openssh.config import ConfigReader
from launcher.transport.openssh.session import OpenSSHHost, session_argv, ssh_failure
from launcher.transport.options import SSHOptions
from testbed.sshd import SshdServer
from tests.support import PYTHON, run_dtrain

WRITE_MARKER = "import sys; open(sys.argv[1], 'w').write('ran')"


@pytest.fixture
def private_sshd():
    """An sshd of the test's own (its host key gets regenerated)."""
    server = SshdServer()
    yield server
    server.close()


def _launch(config: Path, host: str, *args: str):
    return run_dtrain(["launch", "-H", f"{host}:1", "--ssh-config", str(config),
                       "--ssh-client", "openssh", *args])


def test_a_rank_behind_a_proxyjump_host_runs_and_its_exit_code_comes_back(sshd, tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(sshd.config_block("loopback") + sshd.config_block("behind")
                      + "  ProxyJump loopback\n")
    marker = tmp_path / "ran"
    res = _launch(config, "behind", "--", PYTHON, "-c", WRITE_MARKER + "; sys.exit(3)",
                  str(marker))
    assert res.returncode == 3, res.stderr
    assert marker.read_text() == "ran"


def test_a_changed_host_key_is_refused_even_with_accept_new(private_sshd, tmp_path):
    private_sshd.regenerate_host_key()
    marker = tmp_path / "ran"
    res = _launch(private_sshd.ssh_config, "loopback", "--ssh-accept-new", "--", PYTHON, "-c",
                  WRITE_MARKER, str(marker))
    assert res.returncode == 255, res.stderr
    [error] = res.stderr.splitlines()
    assert error.startswith(f"dtrain: error: host key of loopback ({private_sshd.key_name}) "
                            "has CHANGED")
    assert f"ssh-keygen -R {private_sshd.key_name}" in error
    assert not marker.exists()


def _host() -> OpenSSHHost:
    host = OpenSSHHost(HostEntry("node7", 1), ConfigReader("ssh", SSHOptions(
        config_file=Path(os.devnull))))
    host.learn({"hostname": "10.0.0.7", "user": "ada", "port": "2222"})
    return host


# What OpenSSH 9 writes to stderr before exiting 255, and what the error must say.
SSH_STDERR = {
    "unknown key": ("No ED25519 host key is known for [10.0.0.7]:2222 and you have requested "
                    "strict checking.\r\nHost key verification failed.\r\n",
                    "host key of node7 ([10.0.0.7]:2222) is not known", "--ssh-accept-new"),
    "auth": ("ada@10.0.0.7: Permission denied (publickey).\r\n",
             "authentication failed as ada", "authorized_keys"),
    "refused": ("ssh: connect to host 10.0.0.7 port 2222: Connection refused\r\n",
                "connection refused", "sshd runs there"),
    "no name": ("ssh: Could not resolve hostname node7: Name or service not known\r\n",
                "could not resolve hostname", "Check the host name"),
    "other": ("kex_exchange_identification: read: Connection reset by peer\r\n",
              "ssh exited 255: kex_exchange_identification", "ssh -v node7 true"),
}


@pytest.mark.parametrize("case", list(SSH_STDERR))
def test_each_ssh_failure_becomes_one_error_naming_the_host_and_the_fix(case):
    stderr, why, fix = SSH_STDERR[case]
    error = ssh_failure(_host(), stderr)
    assert error.exit_code == 255
    assert "[ada@10.0.0.7:2222]" in str(error) and why in str(error), str(error)
    assert fix in error.fix


def test_the_ssh_command_checks_keys_never_prompts_and_quotes_the_agent_command(tmp_path):
    opts = SSHOptions(config_file=tmp_path / "cfg", known_hosts=tmp_path / "a b%h")
    argv = session_argv("/usr/bin/ssh", HostEntry("node7", 1, user="ada", port=2222), opts, {},
                        "/opt/py thon/bin/python")
    split = argv.index("--")
    options, (host, command) = argv[:split], argv[split + 1:]
    assert host == "node7" and command == "'/opt/py thon/bin/python' -E -P -u -m launcher.agent"
    for pair in ("BatchMode=yes", "StrictHostKeyChecking=yes", "ConnectTimeout=10"):
        assert options[options.index(pair) - 1] == "-o"
    assert options[-8:] == ["-F", str(tmp_path / "cfg"),
                            "-o", f'UserKnownHostsFile="{tmp_path}/a b%%h"',  # no %h token
                            "-l", "ada", "-p", "2222"]
    accept = session_argv("ssh", HostEntry("node7", 1), SSHOptions(accept_new=True),
                          {"connecttimeout": "3"}, "/usr/bin/python3")
    assert "StrictHostKeyChecking=accept-new" in accept
    assert not any(a.startswith("ConnectTimeout") for a in accept)  # the config's wins
