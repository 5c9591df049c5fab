"""A multi-host cluster on one machine: network namespaces on a bridge, one sshd each.

Layout for a fixture instance with suffix ``S`` and subnet ``10.A.B.0/24``::

    root namespace: bridge dtbS 10.A.B.1/24 (the head) -- veth dtvS<i> --+
    namespace dtrain-S-node<i>: eth0 10.A.B.<i+1>/24, lo up, sshd on :22 <--+

Each sshd runs as ``ip netns exec NS unshare --uts -- sh -c 'hostname node<i> && exec sshd
-D ...'``: ``ip netns exec``, ``unshare`` (without --fork) and ``sh -c 'exec'`` all exec in
place, so the PID we start *is* the daemon, and its UTS namespace gives it its own hostname.

Names and the subnet are random per instance (chosen under a file lock, avoiding every route
and address in use) because several test sessions share this machine. Cleanup kills only PIDs
we recorded or that ``ip netns pids`` lists inside our own namespaces; a crashed session's
leftovers are reaped by the next instance through a state file naming the creator PID.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import ipaddress
import os
import random
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from testbed.sshd import (
    REALISTIC_CLIENT_ALIVE,
    SSHD,
    ClientAlive,
    ensure_privsep_dir,
    keygen,
    kill_pids,
    public_key_fields,
    sshd_config_text,
    stop_process,
    wait_for_port,
)
from testbed.stale import STATE_DIR, abandoned, record, remove_scratch


@functools.lru_cache(maxsize=1)
def netns_available() -> tuple[bool, str]:
    """(usable, reason): root, the tools, and a real probe (containers often lack the caps)."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces, veth, bridge)"
    for tool in ("ip", "unshare", "ssh-keygen"):
        if not shutil.which(tool):
            return False, f"needs the `{tool}` command"
    if not os.path.isfile(SSHD):
        return False, "needs an OpenSSH sshd binary"
    probe = f"dtprobe{secrets.token_hex(3)}"
    steps = (["ip", "netns", "add", probe], ["ip", "link", "add", probe, "type", "bridge"],
             ["unshare", "--uts", "--", "true"])
    try:
        for step in steps:
            done = subprocess.run(step, check=False, capture_output=True, text=True)
            if done.returncode != 0:
                return False, f"`{' '.join(step[:3])}` failed: {done.stderr.strip()}"
    finally:
        subprocess.run(["ip", "link", "del", probe], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return True, ""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def _subnets_in_use() -> list[ipaddress.IPv4Network]:
    nets = []
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        if word[:1].isdigit():
            nets.append(ipaddress.ip_network(word, strict=False))
    for line in _ip("-4", "-o", "addr").stdout.splitlines():
        nets.append(ipaddress.ip_network(line.split()[3], strict=False))
    return nets


def _pick_subnet() -> ipaddress.IPv4Network:
    used = _subnets_in_use()
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{random.randint(100, 254)}.{random.randint(1, 254)}.0/24")
        if not any(net.overlaps(other) for other in used):
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet for the test cluster")


def ns_pids(ns: str) -> set[int]:
    result = _ip("netns", "pids", ns, check=False)
    return {int(p) for p in result.stdout.split() if p.isdigit()}


def _remove(namespaces: list[str], links: list[str]) -> None:
    """Kill everything inside our namespaces, then delete them, the veths and the bridge."""
    for ns in namespaces:
        kill_pids(ns_pids(ns))
    for ns in namespaces:
        deadline = time.monotonic() + 5
        while ns_pids(ns) and time.monotonic() < deadline:
            time.sleep(0.05)
        _ip("netns", "del", ns, check=False)
    for link in links:  # namespace teardown is asynchronous; do not leave the veths to it
        _ip("link", "del", link, check=False)


def reap_stale(state_dir: Path = STATE_DIR) -> None:
    """Remove clusters whose creating process is gone (a crashed or SIGKILLed session)."""
    for path, state in abandoned("netns", ("namespaces", "links"), state_dir):
        _remove(state["namespaces"], state["links"])
        remove_scratch(state.get("dir"), "dtrain-netns-")
        path.unlink(missing_ok=True)


class NetnsCluster:
    """``n_hosts`` SSH hosts named node1..nodeN, reachable from the root namespace (the head)."""

    def __init__(self, n_hosts: int = 3, *, sshd: bool = True,
                 client_alive: ClientAlive = REALISTIC_CLIENT_ALIVE) -> None:
        """``client_alive``: how soon each host's sshd drops a silent head (`ClientAlive`)."""
        ensure_privsep_dir()
        STATE_DIR.mkdir(mode=0o700, exist_ok=True)
        reap_stale()
        self.suffix = secrets.token_hex(3)
        self.hosts = [f"node{i}" for i in range(1, n_hosts + 1)]
        self.dir = Path(tempfile.mkdtemp(prefix=f"dtrain-netns-{self.suffix}-"))
        self.bridge = f"dtb{self.suffix}"
        self._ns = {h: f"dtrain-{self.suffix}-{h}" for h in self.hosts}
        self._veth = {h: f"dtv{self.suffix}{i}" for i, h in enumerate(self.hosts, 1)}
        self._links = [*self._veth.values(), self.bridge]
        self._procs: dict[str, subprocess.Popen | None] = {}
        self._closed = False
        self.client_alive = client_alive
        self._state = STATE_DIR / f"netns-{self.suffix}.json"
        atexit.register(self.close)
        self.client_key = self.dir / "id_ed25519"
        self.ssh_config = self.dir / "ssh_config"
        self.known_hosts = self.dir / "known_hosts"
        try:
            self._build_network()
            self._write_keys_and_configs()
            for host in self.hosts if sshd else ():  # a Slurm cluster may run without SSH
                self.start_sshd(host)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ topology
    def _build_network(self) -> None:
        with open(STATE_DIR / "subnet.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent sessions must not pick one subnet
            self.subnet = _pick_subnet()
            record(self._state, links=self._links, namespaces=list(self._ns.values()),
                   dir=str(self.dir))
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet[1]}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, host in enumerate(self.hosts, 1):
            ns, outer, inner = self._ns[host], self._veth[host], f"dtp{self.suffix}{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", ns, "link", "set", inner, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")

    def _write_keys_and_configs(self) -> None:
        authorized = self.dir / "authorized_keys"
        authorized.write_text(keygen(self.client_key, "dtrain-cluster-client") + "\n")
        known, blocks = [], []
        for host in self.hosts:
            pub = keygen(self.dir / f"{host}_host_ed25519", f"dtrain-{host}")
            known.append(f"{self.address(host)} {public_key_fields(pub)}\n")
            blocks.append(f"Host {host}\n  HostName {self.address(host)}\n  Port 22\n"
                          f"  User root\n  IdentityFile {self.client_key}\n"
                          f"  IdentitiesOnly yes\n  UserKnownHostsFile {self.known_hosts}\n")
            (self.dir / f"{host}_sshd_config").write_text(sshd_config_text(
                listen=self.address(host), port=22,
                host_key=self.dir / f"{host}_host_ed25519",
                pid_file=self.dir / f"{host}_sshd.pid", authorized_keys=authorized,
                client_alive=self.client_alive))
        self.known_hosts.write_text("".join(known))
        self.ssh_config.write_text("\n".join(blocks))

    # ------------------------------------------------------------ queries
    @property
    def head_address(self) -> str:
        """The root namespace's address on the bridge (where the launcher runs)."""
        return str(self.subnet[1])

    def address(self, host: str) -> str:
        return str(self.subnet[self.hosts.index(host) + 2])

    def unused_address(self) -> str:
        """An address in the subnet that no host owns (a black hole for connect tests)."""
        return str(self.subnet[200])

    def namespace(self, host: str) -> str:
        return self._ns[host]

    def sshd_pid(self, host: str) -> int | None:
        proc = self._procs.get(host)
        return proc.pid if proc is not None and proc.poll() is None else None

    def pids(self, host: str) -> set[int]:
        """Every process inside the host's namespace (`ip netns pids`)."""
        return ns_pids(self._ns[host])

    def job_pids(self, host: str) -> set[int]:
        """Processes on the host other than its sshd daemon (sessions and what they run)."""
        return self.pids(host) - {self.sshd_pid(host)}

    def wait_no_job_pids(self, timeout: float) -> dict[str, set[int]]:
        """Wait until no host runs anything but sshd; returns the leftovers ({} when clean)."""
        return wait_no_pids(self.hosts, self.job_pids, timeout)

    # ------------------------------------------------------------ faults
    def link_down(self, host: str) -> None:
        """Unplug the host's cable at the bridge: packets to and from it vanish silently."""
        _ip("link", "set", self._veth[host], "down")

    def link_up(self, host: str) -> None:
        _ip("link", "set", self._veth[host], "up")

    def start_sshd(self, host: str) -> None:
        """(Re)start the host's sshd with its own hostname (UTS namespace)."""
        log = self.dir / f"{host}_sshd.log"
        script = f"hostname {host} && exec {SSHD} -D -e -f {self.dir / f'{host}_sshd_config'}"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self._ns[host], "unshare", "--uts", "--",
                 "sh", "-c", script],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        self._procs[host] = proc
        wait_for_port(self.address(host), 22, proc, log, name="sshd")

    def kill_sshd(self, host: str) -> None:
        """SIGKILL the host's sshd daemon (its open sessions survive, as on a real host)."""
        proc = self._procs.pop(host, None)
        if proc is not None:
            proc.kill()
            proc.wait()

    # ------------------------------------------------------------ teardown
    def close(self) -> None:
        """Kill what runs in our namespaces, delete them and the bridge; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs.values():
            stop_process(proc, grace=1.0)
        _remove(list(self._ns.values()), self._links)
        for proc in self._procs.values():
            if proc is not None and proc.poll() is None:
                proc.wait()
        self._state.unlink(missing_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        atexit.unregister(self.close)


def wait_no_pids(hosts: Iterable[str], pids_of: Callable[[str], set[int]],
                 timeout: float) -> dict[str, set[int]]:
    """Poll ``pids_of`` on every host until none has a process left or ``timeout`` passes;
    returns the leftovers by host ({} when clean)."""
    deadline = time.monotonic() + timeout
    while True:
        left = {h: pids for h in hosts if (pids := pids_of(h))}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)
