"""ssh_config directives that run a local command are refused in every spelling, before they run.

Each refused config would create a marker file if anything ran it; the tests connect to a real
sshd (or run `dtrain check`/`launch` against it) and assert the marker is absent.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from launcher.errors import ConnectError
from launcher.hosts.hostfile import HostEntry
from launcher.transport.openssh import config as openssh_config
from launcher.transport.ssh import SSHConnection, SSHOptions, resolve_host
from launcher.transport.ssh_config_refusal import parse_line, read_config, refuse_match_exec
from tests.support import DTRAIN_SCRIPT, PYTHON, dtrain_env, run_dtrain

# Match lines that ssh or paramiko would read as `exec`; {cmd} is the quoted marker command.
MATCH_EXEC_SPELLINGS = {
    "quoted criterion": 'Match "exec" {cmd}',
    "single quotes": "Match 'exec' {cmd}",
    "upper case": "MATCH EXEC {cmd}",
    "negated": "Match !exec {cmd}",
    "negated and quoted": 'Match host nowhere !"exec" {cmd}',
    "backslash inside": "Match ex\\ec {cmd}",
    "split quotes": 'Match e"xe"c {cmd}',
    "criterion=argument": "Match exec={cmd}",
    "Key=value with spaces": "  match  =  exec {cmd}",
    "quoted keyword": '"Match" exec {cmd}',
    "after another criterion": "Match host loopback exec {cmd}",
}


def _marker_config(tmp_path: Path, first: str, sshd, name: str = "ssh_config") -> tuple[Path, Path]:
    marker = tmp_path / "ran"
    config = tmp_path / name
    command = f'"touch {marker}"'
    config.write_text(first.format(cmd=command) + "\n  User nobody\n\n"
                      + sshd.config_block("loopback"))
    return config, marker


def _connect(name: str, opts: SSHOptions) -> SSHConnection:
    return SSHConnection.open(resolve_host(name, user=None, port=None, opts=opts), opts)


def _resolve_for_ssh(name: str, opts: SSHOptions) -> None:
    """What --ssh-client openssh does before starting `ssh`: `ssh -G` and the refusals."""
    openssh_config.read_hosts(shutil.which("ssh") or "ssh", [HostEntry(name, 1)], opts)


@pytest.fixture(params=["paramiko", "openssh"])
def connect(request: pytest.FixtureRequest) -> Callable[[str, SSHOptions], object]:
    """Reaching a host as each SSH client does, up to where the config is refused."""
    return _connect if request.param == "paramiko" else _resolve_for_ssh


@pytest.mark.parametrize("spelling", list(MATCH_EXEC_SPELLINGS))
def test_match_exec_is_refused_in_every_spelling_and_nothing_runs(sshd, tmp_path, connect,
                                                                  spelling):
    config, marker = _marker_config(tmp_path, MATCH_EXEC_SPELLINGS[spelling], sshd)
    with pytest.raises(ConnectError) as info:
        connect("loopback", SSHOptions(config_file=config))
    message = str(info.value)
    assert "`Match exec` refused" in message and f"[{config}:1]" in message
    assert "--ssh-allow-config-exec" in message
    assert not marker.exists()


def test_match_exec_in_an_included_file_is_refused_naming_that_file(sshd, tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".ssh" / "conf.d").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    marker = tmp_path / "ran"
    # A relative Include is relative to ~/.ssh (OpenSSH's rule), globs expand in order, and an
    # included file may include again.
    (home / ".ssh" / "conf.d" / "10-plain.conf").write_text("Host other\n  User x\n")
    (home / ".ssh" / "conf.d" / "20-nested.conf").write_text('Include "~/.ssh/deeper"\n')
    (home / ".ssh" / "deeper").write_text(f'# comment\nMatch "exec" "touch {marker}"\n')
    config = tmp_path / "ssh_config"
    config.write_text("Include conf.d/*.conf\n" + sshd.config_block("loopback"))
    with pytest.raises(ConnectError) as info:
        _connect("loopback", SSHOptions(config_file=config))
    assert f"[{home / '.ssh' / 'deeper'}:2]" in str(info.value)
    assert not marker.exists()
    # The opt-in lets paramiko run it (through invoke, which mirrors sys.stdin: give it one
    # that pytest's capture does not guard).
    with open(os.devnull) as devnull:
        monkeypatch.setattr(sys, "stdin", devnull)
        conn = _connect("loopback", SSHOptions(config_file=config, allow_config_exec=True))
    assert conn.run("echo reached", timeout=10)[1] == b"reached\n"
    conn.close()
    assert marker.exists()


def test_the_option_lets_a_quoted_match_exec_run(sshd, tmp_path, monkeypatch):
    config, marker = _marker_config(tmp_path, MATCH_EXEC_SPELLINGS["quoted criterion"], sshd)
    with open(os.devnull) as devnull:
        monkeypatch.setattr(sys, "stdin", devnull)
        resolve_host("loopback", user=None, port=None,
                     opts=SSHOptions(config_file=config, allow_config_exec=True))
    assert marker.exists()


# Directives with which ssh runs a local command for one host; {cmd} creates the marker.
HOST_COMMAND_SPELLINGS = {
    "ProxyCommand=": ("  proxycommand=sh -c {cmd}", "ProxyCommand"),
    "quoted ProxyCommand": ('  ProxyCommand "sh -c {cmd}"', "ProxyCommand"),
    "KnownHostsCommand": ("  KnownHostsCommand sh -c {cmd}", "KnownHostsCommand"),
    "LocalCommand": ("  PermitLocalCommand yes\n  LocalCommand sh -c {cmd}", "LocalCommand"),
    # ssh loads these shared libraries into its helpers: their code runs as the user.
    "PKCS11Provider": ("  PKCS11Provider /tmp/{cmd}.so", "PKCS11Provider"),
    "SecurityKeyProvider": ("  securitykeyprovider=/tmp/{cmd}.so", "SecurityKeyProvider"),
}


@pytest.mark.parametrize("spelling", list(HOST_COMMAND_SPELLINGS))
def test_host_command_directives_are_refused_naming_their_line(sshd, tmp_path, connect, spelling):
    text, name = HOST_COMMAND_SPELLINGS[spelling]
    marker = tmp_path / "ran"
    config = tmp_path / "ssh_config"
    block = sshd.config_block("loopback")
    config.write_text("Host unrelated\n  ProxyCommand none\n\n" + block
                      + text.format(cmd=f"'touch {marker}'") + "\n")
    with pytest.raises(ConnectError) as info:
        connect("loopback", SSHOptions(config_file=config))
    message = str(info.value)
    line = 4 + block.count("\n") + text.count("\n")   # the directive's own line
    assert f"`{name}` refused [{config}:{line}]" in message, message
    assert "--ssh-allow-config-exec" in message and not marker.exists()


def test_local_command_without_permit_local_command_is_not_a_command(sshd, tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(sshd.config_block("loopback") + "  LocalCommand touch /nonexistent\n")
    conn = _connect("loopback", SSHOptions(config_file=config))
    conn.close()


def test_a_proxycommand_of_the_jump_host_is_refused(sshd, tmp_path, connect):
    marker = tmp_path / "ran"
    config = tmp_path / "ssh_config"
    config.write_text(sshd.config_block("behind") + "  ProxyJump=jump\n"
                      + sshd.config_block("jump") + f"  ProxyCommand touch {marker}\n")
    with pytest.raises(ConnectError) as info:
        connect("behind", SSHOptions(config_file=config))
    assert "host jump would run" in str(info.value) and not marker.exists()


def test_a_proxyjump_hop_spelled_as_an_ssh_option_is_refused(sshd, tmp_path, connect):
    marker = tmp_path / "ran"
    config = tmp_path / "ssh_config"
    config.write_text(sshd.config_block("behind")
                      + f'  ProxyJump "-oProxyCommand=touch {marker}"\n')
    # paramiko's resolver sees a name starting with '-', ssh's a quote: either way refused.
    with pytest.raises(ConnectError, match=r"refused.*-oProxyCommand|-oProxyCommand.*refused"):
        connect("behind", SSHOptions(config_file=config))
    assert not marker.exists()


def test_check_and_launch_refuse_once_before_connecting(sshd, tmp_path):
    config, marker = _marker_config(tmp_path, MATCH_EXEC_SPELLINGS["quoted criterion"], sshd)
    config.write_text(config.read_text() + sshd.config_block("loopback2"))
    hosts = ["-H", "loopback:1,loopback2:1", "--ssh-config", str(config)]
    for args in (["check", *hosts], ["launch", *hosts, "--", PYTHON, "-c", "pass"]):
        res = run_dtrain(args)
        assert res.returncode == 255, res.stdout + res.stderr
        assert res.stderr.count("`Match exec` refused") == 1, res.stderr
        assert f"[{config}:1]" in res.stderr and "--ssh-allow-config-exec" in res.stderr
        assert not marker.exists()


def test_match_lines_are_tokenised_like_ssh():
    def refused(text: str) -> bool:
        try:
            refuse_match_exec([parse_line(text, "f:1")])
        except ConnectError:
            return True
        return False

    assert refused('Match "exec" x') and refused("match=EXEC x") and refused("Match !exec x")
    assert not refused("Match host execute-node user exec_user")
    assert not refused("Host exec") and not refused("# Match exec x")
    with pytest.raises(ConnectError, match=r"cannot parse ssh config \[f:1\].*quot"):
        refuse_match_exec([parse_line('Match exec "unterminated', "f:1")])


def test_include_of_a_missing_pattern_is_skipped_and_a_loop_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    loop = tmp_path / ".ssh" / "loop"
    loop.write_text("Include nothing-here-*\nInclude loop\n")
    with pytest.raises(ConnectError, match="Include nesting too deep"):
        read_config(loop)


def test_no_provider_and_the_internal_security_key_provider_are_not_refused(sshd, tmp_path,
                                                                            connect):
    config = tmp_path / "ssh_config"
    config.write_text(sshd.config_block("loopback") + "  PKCS11Provider none\n"
                      "  SecurityKeyProvider internal\n")
    connect("loopback", SSHOptions(config_file=config))


@pytest.fixture
def provider_library(tmp_path):
    """A shared library whose constructor writes ``tmp_path/loaded``: proof that ssh ran it.
    It exports C_GetFunctionList, the symbol ssh looks for before it loads a provider."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a shared library (`make sysdeps` installs gcc)")
    marker = tmp_path / "loaded"
    source = tmp_path / "provider.c"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void loaded(void)'
                      f' {{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n'
                      "int C_GetFunctionList(void **list) { return 5; }\n")
    library = tmp_path / "provider.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library, marker


def test_a_pkcs11_provider_is_refused_before_ssh_loads_it(sshd, tmp_path, provider_library):
    library, marker = provider_library
    config = tmp_path / "ssh_config"
    config.write_text(sshd.config_block("loopback") + f"  PKCS11Provider {library}\n")
    res = run_dtrain(["launch", "-H", "loopback:1", "--ssh-config", str(config), "--ssh-client",
                      "openssh", "--", PYTHON, "-c", "pass"])
    assert res.returncode == 255, res.stderr
    assert f"`PKCS11Provider` refused [{config}:8]" in res.stderr, res.stderr
    assert not marker.exists()


# ssh reads /etc/ssh/ssh_config (and what it includes) whenever it is not given -F, whether or
# not ~/.ssh/config exists. Each test replaces /etc/ssh, and hides ~/.ssh, in a mount namespace
# of its own: nothing outside it sees the change.
SYSTEM_DIRECTIVES = {
    "Match exec": ('Match exec "touch {marker}"\n', 1),
    "ProxyCommand": ("  ProxyCommand sh -c 'touch {marker}'\n", 8),
}


@pytest.mark.parametrize("directive", list(SYSTEM_DIRECTIVES))
def test_the_system_ssh_config_is_refused_too_when_there_is_no_user_config(sshd, tmp_path,
                                                                            directive):
    text, line = SYSTEM_DIRECTIVES[directive]
    marker = tmp_path / "ran"
    etc_ssh = tmp_path / "etc-ssh"
    (etc_ssh / "ssh_config.d").mkdir(parents=True)
    (etc_ssh / "ssh_config").write_text("Include /etc/ssh/ssh_config.d/*.conf\nHost *\n"
                                        "  SendEnv LANG LC_*\n")
    site = etc_ssh / "ssh_config.d" / "50-site.conf"
    block = sshd.config_block("loopback")
    site.write_text(text.format(marker=marker) + block if line == 1
                    else block + text.format(marker=marker))
    empty = tmp_path / "empty"
    empty.mkdir()
    dot_ssh = Path(pwd.getpwuid(os.getuid()).pw_dir) / ".ssh"
    script = ('mount --bind "$1" /etc/ssh && { [ ! -d "$2" ] || mount --bind "$3" "$2"; } '
              '&& shift 3 && exec "$@"')
    argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh",
            str(etc_ssh), str(dot_ssh), str(empty), DTRAIN_SCRIPT, "launch", "-H", "loopback:1",
            "--ssh-client", "openssh", "--", PYTHON, "-c", "pass"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=dtrain_env())
    assert res.returncode == 255, res.stderr
    shown = "/etc/ssh/ssh_config.d/50-site.conf"
    assert f"`{directive}` refused [{shown}:{line}]" in res.stderr, res.stderr
    assert not marker.exists()
