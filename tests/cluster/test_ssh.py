"""The SSH transport against a real OpenSSH sshd on loopback (and netns hosts for timeouts)."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launcher.errors import ConnectError, HostKeyError
from launcher.transport import ssh_sockets
from launcher.transport.ssh import SSHConnection, SSHOptions, open_all, resolve_host
from testbed.sshd import SshdServer, free_port


def _connect(name: str, **opts: object) -> SSHConnection:
    options = SSHOptions(**opts)
    return SSHConnection.open(resolve_host(name, user=None, port=None, opts=options), options)


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ssh_config"
    path.write_text(text)
    return path


def _fingerprint(pub: Path) -> str:
    """What OpenSSH prints for the key: ``SHA256:...``."""
    out = subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True,
                         check=True).stdout
    return out.split()[1]


@pytest.fixture
def private_sshd():
    """An sshd of the test's own (its host key gets regenerated)."""
    server = SshdServer()
    yield server
    server.close()


def test_run_returns_exit_code_stdout_and_stderr(sshd):
    conn = _connect("loopback", config_file=sshd.ssh_config)
    try:
        assert conn.run("echo hi", timeout=10) == (0, b"hi\n", b"")
        assert conn.run("echo oops >&2; exit 3", timeout=10) == (3, b"", b"oops\n")
        assert conn.latency_ms > 0
    finally:
        conn.close()


def test_alias_from_ssh_config_sets_hostname_port_user_and_identity(sshd):
    host = resolve_host("loopback", user=None, port=None,
                        opts=SSHOptions(config_file=sshd.ssh_config))
    assert (host.hostname, host.port, host.user) == ("127.0.0.1", sshd.port, "root")
    assert host.identity_files == (str(sshd.client_key),)
    assert host.identities_only and host.known_hosts == sshd.known_hosts
    assert host.key_name == f"[127.0.0.1]:{sshd.port}"
    explicit = resolve_host("loopback", user="alice", port=2222,
                            opts=SSHOptions(config_file=sshd.ssh_config))
    assert (explicit.user, explicit.port, explicit.key_name) == ("alice", 2222,
                                                                 "[127.0.0.1]:2222")


def test_unknown_host_key_is_refused_with_sha256_fingerprint_and_nothing_runs(sshd, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    config = _config(tmp_path, sshd.config_block("loopback", known_hosts=empty))
    marker = tmp_path / "ran"
    with pytest.raises(HostKeyError) as info:
        _connect("loopback", config_file=config).run(f"touch {marker}", timeout=10)
    message = str(info.value)
    assert _fingerprint(Path(f"{sshd.host_key}.pub")) in message
    assert f"[root@127.0.0.1:{sshd.port}]" in message and "ssh-ed25519" in message
    assert f"ssh-keyscan -p {sshd.port} 127.0.0.1 >> {empty}" in message
    assert "--ssh-accept-new" in message
    assert info.value.exit_code == 255
    assert not marker.exists() and empty.read_text() == ""


def test_accept_new_records_the_key_with_mode_0600_and_reuses_it(sshd, tmp_path):
    known = tmp_path / "fresh" / ".ssh" / "known_hosts"
    config = _config(tmp_path, sshd.config_block("loopback", known_hosts=known))
    old_umask = os.umask(0)  # the modes must not depend on the caller's umask
    try:
        _connect("loopback", config_file=config, accept_new=True).close()
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(known.stat().st_mode) == 0o600
    assert stat.S_IMODE(known.parent.stat().st_mode) == 0o700
    assert known.read_text() == sshd.host_key_line()
    conn = _connect("loopback", config_file=config)  # no accept_new: the key is known now
    assert conn.run("echo again", timeout=10)[1] == b"again\n"
    conn.close()
    _connect("loopback", config_file=config, accept_new=True).close()
    assert known.read_text() == sshd.host_key_line()  # recorded once


def test_non_22_port_is_not_matched_by_a_bare_host_entry(sshd, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text(sshd.host_key_line().replace(f"[127.0.0.1]:{sshd.port}", "127.0.0.1"))
    config = _config(tmp_path, sshd.config_block("loopback", known_hosts=known))
    with pytest.raises(HostKeyError, match="is not known"):
        _connect("loopback", config_file=config)


def test_accept_new_appends_after_a_last_line_without_newline(sshd, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("other.example ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOnly1NeWline4X0000000")
    config = _config(tmp_path, sshd.config_block("loopback", known_hosts=known))
    _connect("loopback", config_file=config, accept_new=True).close()
    assert known.read_text().splitlines()[1] == sshd.host_key_line().strip()


def test_parallel_first_contacts_record_the_key_once(sshd, tmp_path):
    known = tmp_path / "known_hosts"
    aliases = [f"twin{i}" for i in range(4)]
    config = _config(tmp_path, "".join(sshd.config_block(a, known_hosts=known) for a in aliases))
    opts = SSHOptions(config_file=config, accept_new=True)
    conns = open_all([resolve_host(a, user=None, port=None, opts=opts) for a in aliases], opts)
    assert all(isinstance(c, SSHConnection) for c in conns), conns
    for conn in conns:
        conn.close()
    assert known.read_text() == sshd.host_key_line()


def test_changed_host_key_is_refused_even_with_accept_new(private_sshd, tmp_path):
    private_sshd.regenerate_host_key()
    marker = tmp_path / "ran"
    with pytest.raises(HostKeyError) as info:
        conn = _connect("loopback", config_file=private_sshd.ssh_config, accept_new=True)
        conn.run(f"touch {marker}", timeout=10)
    message = str(info.value)
    assert "CHANGED" in message and "man-in-the-middle" in message
    assert f"{private_sshd.known_hosts}:1" in message
    assert _fingerprint(Path(f"{private_sshd.host_key}.pub")) in message
    assert not marker.exists()


def test_refused_port_fails_fast_naming_the_port(tmp_path):
    port = free_port()
    start = time.monotonic()
    with pytest.raises(ConnectError) as info:
        _connect("127.0.0.1", config_file=_config(tmp_path, f"Host *\n  Port {port}\n"))
    assert time.monotonic() - start < 3
    assert "connection refused" in str(info.value) and f":{port}]" in str(info.value)


def test_unplugged_host_fails_within_connect_timeout(netns_cluster):
    netns_cluster.link_down("node3")
    try:
        start = time.monotonic()
        with pytest.raises(ConnectError) as info:
            _connect("node3", config_file=netns_cluster.ssh_config, connect_timeout=2.0)
        assert time.monotonic() - start < 2.0 + 3
    finally:
        netns_cluster.link_up("node3")
    assert "timed out" in str(info.value) or "no route" in str(info.value)
    assert f"root@{netns_cluster.address('node3')}:22" in str(info.value)


def test_unused_address_fails_within_connect_timeout(netns_cluster, tmp_path):
    start = time.monotonic()
    with pytest.raises(ConnectError) as info:
        _connect(netns_cluster.unused_address(), connect_timeout=1.5,
                 config_file=_config(tmp_path, "Host *\n  User root\n"))
    assert time.monotonic() - start < 1.5 + 3
    assert "timed out" in str(info.value) or "no route" in str(info.value)


def test_failed_auth_lists_tried_keys_and_never_prompts(sshd, tmp_path, monkeypatch):
    monkeypatch.setenv("SSH_AUTH_SOCK", str(tmp_path / "dead-agent.sock"))
    stranger = sshd.new_client_key("stranger", authorize=False)
    config = _config(tmp_path, sshd.config_block("loopback", identity=stranger))
    start = time.monotonic()
    with pytest.raises(ConnectError) as info:
        _connect("loopback", config_file=config)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "authentication failed (publickey) as root" in message
    assert f"{stranger} (rejected)" in message and "never prompts" in message


def test_passphrase_protected_key_without_agent_is_explained(sshd, tmp_path, monkeypatch):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    locked = tmp_path / "locked_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "s3cret", "-f", str(locked)],
                   check=True)
    config = _config(tmp_path, sshd.config_block("loopback", identity=locked))
    with pytest.raises(ConnectError) as info:
        _connect("loopback", config_file=config)
    assert f"{locked} (passphrase-protected: load it into ssh-agent)" in str(info.value)
    assert "s3cret" not in str(info.value)


@pytest.fixture
def ssh_agent(tmp_path, monkeypatch):
    """A real ssh-agent of this test, reachable through SSH_AUTH_SOCK."""
    if shutil.which("ssh-agent") is None or shutil.which("ssh-add") is None:
        pytest.skip("no OpenSSH ssh-agent/ssh-add")
    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 5
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
    yield sock
    agent.kill()
    agent.wait()


def _ssh_add(key: Path, passphrase: str, tmp_path: Path) -> None:
    askpass = tmp_path / "askpass.sh"
    askpass.write_text(f"#!/bin/sh\necho {passphrase}\n")
    askpass.chmod(0o700)
    env = {**os.environ, "SSH_ASKPASS": str(askpass), "SSH_ASKPASS_REQUIRE": "force"}
    subprocess.run(["ssh-add", str(key)], env=env, check=True, capture_output=True,
                   stdin=subprocess.DEVNULL)


def test_identities_only_uses_the_agent_copy_of_a_passphrase_protected_key(
        sshd, tmp_path, ssh_agent):
    locked = tmp_path / "locked_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "s3cret", "-f", str(locked)],
                   check=True)
    with open(sshd.authorized_keys, "a") as f:
        f.write(Path(f"{locked}.pub").read_text())
    _ssh_add(locked, "s3cret", tmp_path)
    config = _config(tmp_path, sshd.config_block("loopback", identity=locked))
    conn = _connect("loopback", config_file=config)
    assert conn.run("echo agent", timeout=10)[1] == b"agent\n"
    conn.close()


def test_identities_only_does_not_offer_unlisted_agent_keys(sshd, tmp_path, ssh_agent):
    _ssh_add(sshd.client_key, "unused", tmp_path)  # authorized, but not the IdentityFile
    stranger = sshd.new_client_key("stranger2", authorize=False)
    config = _config(tmp_path, sshd.config_block("loopback", identity=stranger))
    with pytest.raises(ConnectError) as info:
        _connect("loopback", config_file=config)
    assert "agent key" not in str(info.value)
    unrestricted = _config(tmp_path, sshd.config_block("loopback", identity=stranger)
                           .replace("IdentitiesOnly yes", "IdentitiesOnly no"))
    _connect("loopback", config_file=unrestricted).close()  # the agent key is offered now


def test_key_auth_works_with_a_dead_agent_socket(sshd, tmp_path, monkeypatch):
    monkeypatch.setenv("SSH_AUTH_SOCK", str(tmp_path / "dead-agent.sock"))
    conn = _connect("loopback", config_file=sshd.ssh_config)
    assert conn.run("true", timeout=10)[0] == 0
    conn.close()


def test_match_exec_in_config_is_refused_and_its_command_not_run(sshd, tmp_path, monkeypatch):
    marker = tmp_path / "match-ran"
    config = _config(tmp_path, f'Match exec "touch {marker}"\n  User nobody\n\n'
                               + sshd.config_block("loopback"))
    with pytest.raises(ConnectError) as info:
        _connect("loopback", config_file=config)
    assert "Match exec" in str(info.value) and f"[{config}:1]" in str(info.value)
    assert not marker.exists()
    # The refusal is what kept it from running: with the opt-in, paramiko runs it (through
    # invoke, which mirrors sys.stdin: give it one that pytest's capture does not guard).
    with open(os.devnull) as devnull:
        monkeypatch.setattr(sys, "stdin", devnull)
        resolve_host("loopback", user=None, port=None,
                     opts=SSHOptions(config_file=config, allow_config_exec=True))
    assert marker.exists()


def test_proxycommand_is_refused_unless_allowed(sshd, tmp_path):
    marker = tmp_path / "proxy-ran"
    relay = (f"sh -c 'touch {marker}; exec ssh -F {sshd.ssh_config} -o BatchMode=yes "
             "-W %h:%p loopback'")
    config = _config(tmp_path, sshd.config_block("loopback") + f"  ProxyCommand {relay}\n")
    with pytest.raises(ConnectError) as info:
        _connect("loopback", config_file=config)
    assert "ProxyCommand" in str(info.value) and str(config) in str(info.value)
    assert not marker.exists()
    if shutil.which("ssh") is None:
        pytest.skip("no OpenSSH client to relay through")
    conn = _connect("loopback", config_file=config, allow_config_exec=True)
    assert conn.run("echo relayed", timeout=10)[1] == b"relayed\n" and marker.exists()
    conn.close()


def test_proxyjump_goes_through_the_jump_host_and_verifies_both_keys(sshd, tmp_path):
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    config = _config(tmp_path, sshd.config_block("loopback")
                     + sshd.config_block("behind") + "  ProxyJump loopback\n"
                     + sshd.config_block("unknownkey", known_hosts=empty)
                     + "  ProxyJump loopback\n")
    host = resolve_host("behind", user=None, port=None, opts=SSHOptions(config_file=config))
    assert host.jump is not None and host.jump.alias == "loopback"
    conn = _connect("behind", config_file=config)
    assert conn.run("echo through", timeout=10)[1] == b"through\n"
    conn.close()
    with pytest.raises(HostKeyError) as info:
        _connect("unknownkey", config_file=config)
    assert str(empty) in str(info.value)


def test_the_ssh_socket_sends_small_packets_at_once_and_acks_every_read_at_once(sshd):
    """Nagle and delayed ACKs cost a launch ~40 ms per stalled exchange (`_PromptSocket`)."""
    host = resolve_host("loopback", user=None, port=None,
                        opts=SSHOptions(config_file=sshd.ssh_config))
    sock = ssh_sockets.tcp_connect(host, keepalive=15.0)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert sock.recv(64).startswith(b"SSH-2.0-")  # sshd's banner
        sock.sendall(b"SSH-2.0-dtrain_test\r\n")
        assert sock.recv(4096)  # sshd's KEXINIT: after a send and a read, a plain Linux
        # socket is in delayed-ACK ("pingpong") mode and reads 0 here
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK)
    finally:
        sock.close()


def test_agent_stream_round_trip_with_cat(sshd):
    conn = _connect("loopback", config_file=sshd.ssh_config)
    try:
        stream = conn.exec_stream("cat")
        payload = os.urandom(300_000)
        writer = threading.Thread(target=stream.write, args=(payload,))
        writer.start()
        received = bytearray()
        while len(received) < len(payload):
            chunk = stream.read()
            assert chunk, "EOF before the echo was complete"
            received += chunk
        writer.join()
        assert bytes(received) == payload and stream.host == "loopback"
        stream.close()
        assert stream.read() == b""
        assert stream.wait(10) == 0
        with pytest.raises(OSError):
            stream.write(b"after close")
    finally:
        conn.close()


def test_an_idle_connection_polls_once_a_second_and_still_closes_at_once(sshd):
    conn = _connect("loopback", config_file=sshd.ssh_config)
    transport = conn.transport
    assert transport.sock.gettimeout() == ssh_sockets.IDLE_POLL_S >= 1.0
    time.sleep(0.3)  # its thread is blocked reading, for up to a second
    start = time.monotonic()
    conn.close()
    transport.join(5)
    assert not transport.is_alive()
    assert time.monotonic() - start < ssh_sockets.IDLE_POLL_S / 2  # not a poll's wait


def test_stream_collects_stderr_and_exit_code(sshd):
    conn = _connect("loopback", config_file=sshd.ssh_config)
    try:
        stream = conn.exec_stream("echo 'Traceback: agent failed' >&2; exit 7")
        assert stream.read() == b""
        assert stream.wait(10) == 7
        assert "Traceback: agent failed" in stream.stderr_text()
    finally:
        conn.close()


def test_wait_reports_none_not_minus_one_when_killed_by_a_signal(sshd):
    conn = _connect("loopback", config_file=sshd.ssh_config)
    try:
        stream = conn.exec_stream("kill -9 $$")
        assert stream.read() == b""
        assert stream.wait(10) is None and stream.exited()
        assert conn.run("kill -9 $$", timeout=10)[0] == 255
    finally:
        conn.close()


def test_partitioned_host_is_detected_by_keepalive_and_leaves_nothing(netns_cluster):
    conn = _connect("node1", config_file=netns_cluster.ssh_config, keepalive=1.0)
    stream = conn.exec_stream("exec cat")
    try:
        stream.write(b"ping\n")
        assert stream.read() == b"ping\n"
        netns_cluster.link_down("node1")
        start = time.monotonic()
        assert stream.read() == b""  # transport dropped after ~4 unacknowledged keepalives
        assert time.monotonic() - start < 15
        assert stream.wait(1) is None
    finally:
        netns_cluster.link_up("node1")
        conn.close()
    # node1's sshd gave up on us too (the fixture's FAST_CLIENT_ALIVE: 3 s, well inside the
    # 15 s waited), so cat lost its stdin and exited.
    assert netns_cluster.wait_no_job_pids(timeout=15) == {}


def test_killed_sshd_session_reads_as_eof_and_unknown_status(netns_cluster):
    conn = _connect("node2", config_file=netns_cluster.ssh_config)
    try:
        stream = conn.exec_stream("echo up; exec sleep 60")
        assert stream.read() == b"up\n"
        for pid in netns_cluster.job_pids("node2"):
            os.kill(pid, 9)
        assert stream.read() == b""
        assert stream.wait(5) is None
    finally:
        conn.close()
    assert netns_cluster.wait_no_job_pids(timeout=10) == {}


def test_run_times_out_with_a_clear_error(sshd):
    conn = _connect("loopback", config_file=sshd.ssh_config)
    try:
        with pytest.raises(ConnectError, match="did not finish within 0.5 s"):
            conn.run("sleep 5", timeout=0.5)
    finally:
        conn.close()


def test_open_all_keeps_host_order_and_reports_each_failure(sshd, tmp_path):
    dead_port = free_port()
    config = _config(tmp_path, sshd.config_block("loopback")
                     + sshd.config_block("deadport").replace(f"Port {sshd.port}",
                                                             f"Port {dead_port}"))
    opts = SSHOptions(config_file=config, max_parallel=2)
    hosts = [resolve_host(n, user=None, port=None, opts=opts) for n in ("deadport", "loopback")]
    failed, ok = open_all(hosts, opts)
    assert isinstance(failed, ConnectError) and "deadport" in str(failed)
    assert isinstance(ok, SSHConnection) and ok.run("echo ok", timeout=10)[1] == b"ok\n"
    ok.close()


@pytest.mark.parametrize("name", ["-oProxyCommand=touch /tmp/pwn", "h1;reboot", "h1$(id)",
                                  "h1\n", "%h", "a b", ""])
def test_host_names_with_option_or_shell_characters_are_refused(name):
    with pytest.raises(ConnectError, match="refused"):
        resolve_host(name, user=None, port=None, opts=SSHOptions(config_file=Path("/dev/null")))


def test_hashed_known_hosts_entries_are_honoured(sshd, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text(sshd.host_key_line())
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(known)], check=True,
                   capture_output=True)
    assert known.read_text().startswith("|1|")
    config = _config(tmp_path, sshd.config_block("loopback", known_hosts=known))
    _connect("loopback", config_file=config).close()


def test_revoked_host_key_is_refused(sshd, tmp_path):
    known = tmp_path / "known_hosts"
    pub = " ".join(Path(f"{sshd.host_key}.pub").read_text().split()[:2])
    known.write_text(sshd.host_key_line() + f"@revoked * {pub}\n")
    config = _config(tmp_path, sshd.config_block("loopback", known_hosts=known))
    with pytest.raises(HostKeyError, match="revoked"):
        _connect("loopback", config_file=config)


def test_silent_server_hits_the_banner_timeout(tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted: list[socket.socket] = []
    acceptor = threading.Thread(target=lambda: accepted.append(listener.accept()[0]))
    acceptor.start()
    config = _config(tmp_path, f"Host *\n  Port {listener.getsockname()[1]}\n")
    start = time.monotonic()
    try:
        with pytest.raises(ConnectError, match="no SSH banner within 1 s"):
            _connect("127.0.0.1", config_file=config, banner_timeout=1.0)
        assert time.monotonic() - start < 5
    finally:
        acceptor.join(5)
        for sock in accepted:
            sock.close()
        listener.close()
