"""A real OpenSSH sshd on 127.0.0.1:<free port>, with generated keys, for SSH tests.

`SshdServer` runs ``sshd -D -e -f <cfg>`` as root from a private temporary directory (host key,
client key, authorized_keys, pid file, log) and writes the client side next to it: a
``known_hosts`` with the ``[127.0.0.1]:port`` entry and an ``ssh_config`` with ``Host
loopback``. The helpers (`keygen`, `sshd_config_text`, `stop_process`, ...) are shared with
`testbed.netns`.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from testbed.procfs import descendants

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


@dataclass(frozen=True)
class ClientAlive:
    """How sshd probes a client that has gone quiet (``ClientAliveInterval`` seconds between
    probes, dropped after ``ClientAliveCountMax`` unanswered ones): ``interval x count_max``
    seconds after its last answer, sshd ends the session and everything it runs."""

    interval: int
    count_max: int


#: What a cluster's sshd does: OpenSSH's default is off (a dead client's session stays until
#: TCP gives up), clusters that set it use tens of seconds. A head that answers its probes a
#: few seconds late, as any process may on a loaded machine (64 namespace hosts' agents and
#: ranks start on this machine's 2 cores at once), keeps its sessions.
REALISTIC_CLIENT_ALIVE = ClientAlive(interval=15, count_max=3)
#: Only for tests that cut a host's cable and then check that nothing is left on it within
#: seconds (the head is gone for that host's sshd, which must give up on it quickly): 3 s.
FAST_CLIENT_ALIVE = ClientAlive(interval=1, count_max=3)


def sshd_available() -> bool:
    return os.path.isfile(SSHD) and os.access(SSHD, os.X_OK) and bool(shutil.which("ssh-keygen"))


def keygen(path: Path, comment: str) -> str:
    """Create an unencrypted ed25519 key pair at ``path``; return the public line."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment,
                    "-f", str(path)], check=True, stdin=subprocess.DEVNULL)
    return Path(f"{path}.pub").read_text().strip()


def public_key_fields(pub_line: str) -> str:
    """``keytype base64`` of a public key line (without its comment)."""
    return " ".join(pub_line.split()[:2])


def sshd_config_text(*, listen: str, port: int, host_key: Path, pid_file: Path,
                     authorized_keys: Path, extra: str = "",
                     client_alive: ClientAlive = REALISTIC_CLIENT_ALIVE) -> str:
    """A self-contained sshd_config: key auth only, ``client_alive``'s dead-client detection,
    quiet logs."""
    return f"""\
{extra}
ListenAddress {listen}
Port {port}
HostKey {host_key}
PidFile {pid_file}
AuthorizedKeysFile {authorized_keys}
StrictModes no
UsePAM no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
ClientAliveInterval {client_alive.interval}
ClientAliveCountMax {client_alive.count_max}
MaxStartups 64
LogLevel ERROR
UseDNS no
X11Forwarding no
AllowTcpForwarding yes
"""


def ensure_privsep_dir() -> None:
    """sshd refuses to start without its privilege-separation directory."""
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)


#: Where `free_port` picks: below the kernel's ephemeral range (32768-60999 by default), which
#: the outgoing connections of tests running in parallel draw their local ports from.
PICKED_PORTS = (20000, 32768)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing on ``host`` is bound to now, for a daemon or test to listen on soon.
    Not reserved: the kernel's pick (port 0) comes from the ephemeral range, where any
    connection made from ``host`` in the meantime (a parallel test's ssh to a namespace host)
    may take it first, which failed CI once (2026-11-30, a Slurm controller: "Address already
    in use"); a random port below that range is only ever taken by another such pick."""
    low, high = PICKED_PORTS
    for _ in range(100):
        port = random.randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host} in {low}-{high - 1} after 100 tries")


class DaemonExited(RuntimeError):
    """A daemon exited before it accepted a connection (`wait_for_port`); the message ends with
    its log, which says why (a caller may start it again on another port when that is the port
    being taken)."""


def log_tail(*logs: Path) -> str:
    """The last 2,000 characters of each log that exists, in order."""
    return "".join(log.read_text(errors="replace")[-2000:] for log in logs if log.exists())


def wait_for_port(host: str, port: int, proc: subprocess.Popen, *logs: Path, name: str,
                  timeout: float = 10.0) -> None:
    """Block until ``host:port`` accepts; raise `DaemonExited` if the daemon ``name`` (``proc``)
    exits first, RuntimeError if it is still not accepting after ``timeout`` seconds, both with
    the tail of its ``logs``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DaemonExited(f"{name} did not start [{host}:{port}]: it exited with "
                               f"{proc.returncode}. Its log:\n{log_tail(*logs)}")
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{name} did not start [{host}:{port}]: not accepting after {timeout} s. "
                       f"Its log:\n{log_tail(*logs)}")


def kill_pids(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stop_process(proc: subprocess.Popen | None, grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL after ``grace``; always reaps."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class SshdServer:
    """One sshd on loopback; ``ssh_config``/``known_hosts``/``client_key`` for clients."""

    host = "127.0.0.1"
    alias = "loopback"

    def __init__(self, extra_config: str = "") -> None:
        ensure_privsep_dir()
        self.dir = Path(tempfile.mkdtemp(prefix="dtrain-sshd-"))
        self.extra_config = extra_config
        self.host_key = self.dir / "host_ed25519"
        self.client_key = self.dir / "id_ed25519"
        self.authorized_keys = self.dir / "authorized_keys"
        self.known_hosts = self.dir / "known_hosts"
        self.ssh_config = self.dir / "ssh_config"
        self.log = self.dir / "sshd.log"
        self.port = 0
        self._proc: subprocess.Popen | None = None
        keygen(self.host_key, "dtrain-test-host")
        self.authorized_keys.write_text(keygen(self.client_key, "dtrain-test-client") + "\n")
        self.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc and self._proc.poll() is None else None

    @property
    def key_name(self) -> str:
        return f"[{self.host}]:{self.port}"

    def host_key_line(self) -> str:
        """The known_hosts line for the current host key."""
        pub = Path(f"{self.host_key}.pub").read_text()
        return f"{self.key_name} {public_key_fields(pub)}\n"

    def start(self) -> None:
        """Start sshd (on a new free port the first time, on the same port afterwards)."""
        fixed = self.port != 0
        for _ in range(1 if fixed else 5):
            port = self.port if fixed else free_port()
            cfg = self.dir / "sshd_config"
            cfg.write_text(sshd_config_text(
                listen=self.host, port=port, host_key=self.host_key,
                pid_file=self.dir / "sshd.pid", authorized_keys=self.authorized_keys,
                extra=self.extra_config))
            with open(self.log, "ab") as log:
                self._proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(cfg)],
                                              stdin=subprocess.DEVNULL, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True)
            try:
                wait_for_port(self.host, port, self._proc, self.log, name="sshd")
            except RuntimeError:
                stop_process(self._proc)
                if fixed:
                    raise
                continue  # someone took the port between our probe and sshd's bind
            self.port = port
            self._write_client_files()
            return
        raise RuntimeError(f"sshd did not start: {log_tail(self.log)}")

    def _write_client_files(self) -> None:
        if not self.known_hosts.exists():
            self.known_hosts.write_text(self.host_key_line())
        self.ssh_config.write_text(self.config_block(self.alias))

    def config_block(self, alias: str, known_hosts: Path | None = None,
                     identity: Path | None = None) -> str:
        """A ``Host`` block reaching this server under ``alias``."""
        return (f"Host {alias}\n  HostName {self.host}\n  Port {self.port}\n  User root\n"
                f"  IdentityFile {identity or self.client_key}\n  IdentitiesOnly yes\n"
                f"  UserKnownHostsFile {known_hosts or self.known_hosts}\n")

    def new_client_key(self, name: str, authorize: bool) -> Path:
        """Another client key, optionally added to authorized_keys."""
        path = self.dir / name
        pub = keygen(path, f"dtrain-test-{name}")
        if authorize:
            with open(self.authorized_keys, "a") as f:
                f.write(pub + "\n")
        return path

    def regenerate_host_key(self) -> None:
        """Restart with a fresh host key on the same port; known_hosts keeps the old one."""
        self.stop()
        for path in (self.host_key, Path(f"{self.host_key}.pub")):
            path.unlink()
        keygen(self.host_key, "dtrain-test-host-new")
        self.start()

    def stop(self) -> None:
        """Stop the daemon and the sessions it spawned (by recorded PID and its children)."""
        if self._proc is None:
            return
        children = descendants(self._proc.pid) if self._proc.poll() is None else set()
        stop_process(self._proc)
        kill_pids(children)
        self._proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
