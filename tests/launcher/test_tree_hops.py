"""What the head hands a relay per host (`launcher.tree.hops`): the hop it resolved from the
ssh config and the known_hosts lines it holds, refused before anything connects when a host
cannot be relayed; the relay's private known_hosts file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from launcher.errors import HostKeyError, UsageError
from launcher.hosts.hostfile import HostEntry
from launcher.transport.options import SSHOptions
from launcher.tree import hops

KEY = "AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"


def _opts(tmp_path: Path, config: str, known: str) -> SSHOptions:
    (tmp_path / "config").write_text(config)
    (tmp_path / "known_hosts").write_text(known)
    return SSHOptions(config_file=tmp_path / "config", known_hosts=tmp_path / "known_hosts")


def _folder(tmp_path: Path) -> str:
    """A relay's known_hosts folder as its agent makes it (new, 0700)."""
    folder = tmp_path / "relay"
    folder.mkdir(mode=0o700)
    return str(folder)


def test_a_hop_carries_the_resolved_address_and_the_heads_known_hosts_lines(tmp_path):
    opts = _opts(tmp_path, "Host node5\n  HostName 10.0.0.5\n  User alice\n  Port 2222\n"
                 "  IdentityFile /keys/id_ed25519\n  ConnectTimeout 7\n",
                 f"[10.0.0.5]:2222 ssh-ed25519 {KEY}\n10.0.0.9 ssh-ed25519 {KEY}\n")
    [hop] = hops.describe([HostEntry("node5", 1)], opts)
    assert hop == {"client": "paramiko", "hostname": "10.0.0.5", "port": 2222, "user": "alice",
                   "identity_files": ["/keys/id_ed25519"], "identities_only": False,
                   "connect_timeout": 7.0,
                   "known_hosts": [f"[10.0.0.5]:2222 ssh-ed25519 {KEY}"]}
    keys = hops.RelayKeys(_folder(tmp_path))
    try:
        host = keys.resolved("node5", hop)
        assert (host.hostname, host.port, host.user) == ("10.0.0.5", 2222, "alice")
        assert host.read_known_hosts == (keys.file,)
        assert keys.file.read_text() == f"[10.0.0.5]:2222 ssh-ed25519 {KEY}\n"
        assert stat.S_IMODE(keys.file.stat().st_mode) == 0o600
        relay_opts = keys.options(hops.forwarded_options(opts))
        assert relay_opts.accept_new is False and relay_opts.known_hosts == keys.file
    finally:
        keys.remove()
    assert not keys.folder.exists()


def test_a_host_whose_key_the_head_does_not_hold_is_refused_before_anything_connects(tmp_path):
    opts = _opts(tmp_path, "Host node5\n  HostName 10.0.0.5\n", f"10.0.0.9 ssh-ed25519 {KEY}\n")
    with pytest.raises(HostKeyError, match=r"host key of 10.0.0.5 is not known.*ssh-keyscan"):
        hops.describe([HostEntry("node5", 1)], opts)


def test_a_revoked_key_is_not_handed_to_a_relay(tmp_path):
    opts = _opts(tmp_path, "Host node5\n  HostName 10.0.0.5\n",
                 f"10.0.0.5 ssh-ed25519 {KEY}\n@revoked 10.0.0.5 ssh-ed25519 {KEY}\n")
    with pytest.raises(HostKeyError, match="not known"):
        hops.describe([HostEntry("node5", 1)], opts)


@pytest.mark.parametrize("client", ["paramiko", "openssh"])
def test_hosts_behind_a_jump_host_are_not_relayed_with_either_client(tmp_path, client):
    opts = _opts(tmp_path, "Host node5\n  HostName 10.0.0.5\n  ProxyJump bastion\n",
                 f"10.0.0.5 ssh-ed25519 {KEY}\n")
    with pytest.raises(UsageError, match="ProxyJump"):
        hops.describe([HostEntry("node5", 1)], SSHOptions(**{**opts.__dict__, "client": client}))


def test_an_openssh_hop_is_one_argv_with_the_heads_reading_and_strict_keys(tmp_path):
    opts = _opts(tmp_path, "Host node5\n  HostName 10.0.0.5\n  User alice\n  Port 2222\n"
                 "  IdentityFile /keys/id_ed25519\n  IdentitiesOnly yes\n",
                 f"[10.0.0.5]:2222 ssh-ed25519 {KEY}\n")
    opts = SSHOptions(**{**opts.__dict__, "client": "openssh"})
    [hop] = hops.describe([HostEntry("node5", 1)], opts)
    assert hop["client"] == "openssh"
    keys = hops.RelayKeys(_folder(tmp_path))
    try:
        stream = keys.openssh_stream("/bin/true", "node5", hop,
                                     keys.options(hops.forwarded_options(opts)), "agent; rm -rf /")
        argv = stream._proc.args
        stream.wait(5)
        assert argv[:3] == ["/bin/true", "-F", os.devnull]  # the relay's own config unread
        assert argv[-3:] == ["--", "10.0.0.5", "agent; rm -rf /"]  # one word, no shell here
        pairs = {argv[i + 1] for i, word in enumerate(argv) if word == "-o"}
        assert {"BatchMode=yes", "StrictHostKeyChecking=yes", "IdentitiesOnly=yes",
                f'UserKnownHostsFile="{keys.file}"'} <= pairs
        assert argv[argv.index("-i") + 1] == "/keys/id_ed25519"
        assert (argv[argv.index("-l") + 1], argv[argv.index("-p") + 1]) == ("alice", "2222")
        assert keys.file.read_text() == f"[10.0.0.5]:2222 ssh-ed25519 {KEY}\n"
        assert stream.node.where == "alice@10.0.0.5:2222"  # what its errors name
    finally:
        keys.remove()
