"""Real MPICH ranks (mpi4py + the mpich wheel) form one MPI_COMM_WORLD through the PMI cores.

A test-only adapter stands in for the agents and the head: one PmiProxy per fake host, one
KeyValueSpace, a selector loop pumping bytes between the ranks' PMI sockets and the cores, and
the relay messages passed through JSON as they will be on the wire. Ranks get their PMI socket
as an inherited fd (PMI_FD) or connect to a loopback port with a one-time id (PMI_PORT/PMI_ID).
Every process started here is killed through its Popen in ``finally``.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from launcher.plan.job import process_mapping
from launcher.pmi import (
    Abort,
    Close,
    KeyValueSpace,
    PmiProxy,
    RankFailed,
    Reply,
    Send,
    shm_segment_prefixes,
)
from workerenv import SCRUBBED_PREFIXES

SHM_DIR = "/dev/shm"
DEADLINE_S = 90

COLLECTIVES = """
from mpi4py import MPI
c = MPI.COMM_WORLD
total = c.allreduce(c.rank)
payload = c.bcast(bytes(range(128)) if c.rank == 0 else None, root=0)
assert total == c.size * (c.size - 1) // 2, total
assert payload == bytes(range(128))
print(f"ok rank={c.rank} size={c.size}", flush=True)
"""

ABORT = """
from mpi4py import MPI
c = MPI.COMM_WORLD
c.barrier()
if c.rank == 1:
    c.Abort(42)
c.recv(source=1)  # rank 0 waits for a message that never comes
"""

CRASH = """
import os
from mpi4py import MPI
c = MPI.COMM_WORLD
c.barrier()
if c.rank == 1:
    os._exit(3)  # dies without MPI_Finalize: its PMI socket closes early
c.recv(source=1)
"""


@dataclass
class Job:
    """The adapter: cores, sockets and the processes, as the agents and the head would hold."""

    hosts: list[list[int]]
    port_mode: bool = False
    push_bytes: int = KeyValueSpace(hosts=1, kvsname="k").push_bytes
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    events: list = field(default_factory=list)
    sel: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)
    socks: dict[int, tuple[int, socket.socket]] = field(default_factory=dict)
    next_conn: int = 0

    def __post_init__(self) -> None:
        world = sum(len(r) for r in self.hosts)
        mapping = process_mapping([len(r) for r in self.hosts])
        # A fresh kvsname per job: MPICH names its shared memory after it.
        self.kvsname = f"kvs_test_{secrets.token_hex(6)}"
        self.kvs = KeyValueSpace(hosts=len(self.hosts), kvsname=self.kvsname,
                                 push_bytes=self.push_bytes)
        self.sent: list[tuple[int, str]] = []  # (host, op) of each relay message
        self.tokens = [{str(secrets.randbelow(2**31 - 2) + 1): r for r in ranks}
                       for ranks in self.hosts]
        self.proxies = [PmiProxy(ranks=ranks, world_size=world, kvsname=self.kvsname,
                                 process_mapping=mapping,
                                 id_tokens=tokens if self.port_mode else None)
                        for ranks, tokens in zip(self.hosts, self.tokens, strict=True)]
        self.world = world
        self.listeners: list[socket.socket] = []

    def start(self, code: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUBBED_PREFIXES)}
        env["OMP_NUM_THREADS"] = "1"
        for host, ranks in enumerate(self.hosts):
            port = self._listen(host) if self.port_mode else 0
            for rank in ranks:
                # In PMI_PORT mode rank and size reach MPICH only through initack's set lines.
                ids = {} if port else {"PMI_RANK": str(rank), "PMI_SIZE": str(self.world)}
                self._spawn(host, rank, code, dict(env, **ids), port)

    def _listen(self, host: int) -> int:
        lsock = socket.create_server(("127.0.0.1", 0))
        lsock.setblocking(False)
        self.listeners.append(lsock)
        self.sel.register(lsock, selectors.EVENT_READ, ("listen", host))
        return lsock.getsockname()[1]

    def _spawn(self, host: int, rank: int, code: str, env: dict, port: int) -> None:
        if port:
            token = next(t for t, r in self.tokens[host].items() if r == rank)
            env.update(PMI_PORT=f"127.0.0.1:{port}", PMI_ID=token)
            self.procs[rank] = subprocess.Popen([sys.executable, "-c", code], env=env,
                                                stdout=subprocess.PIPE, text=True)
            return
        ours, theirs = socket.socketpair()
        env["PMI_FD"] = str(theirs.fileno())
        try:
            self.procs[rank] = subprocess.Popen([sys.executable, "-c", code], env=env,
                                                pass_fds=[theirs.fileno()],
                                                stdout=subprocess.PIPE, text=True)
        finally:
            theirs.close()
        self._register(host, ours, rank)

    def _register(self, host: int, sock: socket.socket, rank: int | None) -> None:
        self.next_conn += 1
        conn = self.next_conn
        self.socks[conn] = (host, sock)
        self.sel.register(sock, selectors.EVENT_READ, ("conn", conn))
        self.run(host, self.proxies[host].open(conn, rank))

    def connect_forger(self, host: int, data: bytes) -> None:
        """A local process that is not a rank connects to the PMI port and sends ``data``."""
        sock = socket.create_connection(self.listeners[host].getsockname())
        sock.sendall(data)
        sock.close()

    # ----- the loop --------------------------------------------------------------------------

    def pump(self) -> dict[int, int]:
        """Serve PMI until every rank has exited; returns rank -> exit code."""
        deadline = time.monotonic() + DEADLINE_S
        while any(p.poll() is None for p in self.procs.values()) or self.socks:
            if time.monotonic() > deadline:
                raise AssertionError(f"ranks hang; proxies wait on {self.holding_up()}")
            for key, _ in self.sel.select(timeout=0.1):
                kind, ident = key.data
                if kind == "listen":
                    sock, _ = key.fileobj.accept()
                    self._register(ident, sock, None)
                else:
                    self._readable(ident)
        return {rank: p.wait() for rank, p in self.procs.items()}

    def _readable(self, conn: int) -> None:
        host, sock = self.socks[conn]
        try:
            data = sock.recv(65536)
        except ConnectionError:
            data = b""
        if data:
            self.run(host, self.proxies[host].feed(conn, data))
        else:
            self._drop(conn)
            self.run(host, self.proxies[host].closed(conn))

    def _drop(self, conn: int) -> None:
        _, sock = self.socks.pop(conn)
        self.sel.unregister(sock)
        sock.close()

    def run(self, host: int, actions: list) -> None:
        for action in actions:
            if isinstance(action, Reply):
                self.socks[action.conn][1].sendall(action.data)
            elif isinstance(action, Close):
                self.events.append(action)
                self._drop(action.conn)
            elif isinstance(action, Send):
                self._relay(host, action.msg)
            else:  # Abort or RankFailed: the supervisor tears the job down
                self.events.append(action)
                self.kill()

    def _relay(self, host: int, msg: dict) -> None:
        self.sent.append((host, msg["op"]))
        for dest, reply in self.kvs.handle(host, json.loads(json.dumps(msg))):
            self.run(dest, self.proxies[dest].upstream(json.loads(json.dumps(reply))))

    def holding_up(self) -> list[tuple[list[int], list[int]]]:
        """Per host: the ranks a barrier waits for, and those gone without MPI_Init."""
        return [p.holding_up() for p in self.proxies]

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()

    def close(self) -> None:
        self.kill()
        for proc in self.procs.values():
            proc.wait()
            if proc.stdout:
                proc.stdout.close()
        for conn in list(self.socks):
            self._drop(conn)
        for lsock in self.listeners:
            lsock.close()
        self.sel.close()
        self.remove_shm()

    def remove_shm(self) -> None:
        """Killed MPICH ranks leave their shared-memory segments behind; remove this job's."""
        prefixes = shm_segment_prefixes(self.kvsname)
        if os.path.isdir(SHM_DIR):
            for name in os.listdir(SHM_DIR):
                if name.startswith(prefixes):
                    os.unlink(os.path.join(SHM_DIR, name))


def run_job(hosts: list[list[int]], code: str, port_mode: bool = False, forged: bytes = b"",
            push_bytes: int | None = None):
    job = Job(hosts, port_mode=port_mode) if push_bytes is None else \
        Job(hosts, port_mode=port_mode, push_bytes=push_bytes)
    try:
        job.start(code)
        if forged:
            job.connect_forger(0, forged)
        codes = job.pump()
        outputs = {rank: p.stdout.read() for rank, p in job.procs.items()}
        return job, codes, outputs
    finally:
        job.close()


def assert_world_formed(codes: dict[int, int], outputs: dict[int, str], size: int) -> None:
    assert codes == {rank: 0 for rank in range(size)}, outputs
    for rank in range(size):
        assert f"ok rank={rank} size={size}" in outputs[rank]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_two_hosts_of_two_ranks_form_one_world_over_inherited_fds():
    job, codes, outputs = run_job([[0, 1], [2, 3]], COLLECTIVES)
    assert_world_formed(codes, outputs, 4)
    assert job.events == [] and job.kvs.epoch >= 1 and job.kvs.conflicts == []


def test_a_world_forms_when_the_fence_leaves_every_card_at_the_head():
    """Above `launcher.pmi.kvs.PUSH_BYTES` a fence's answer carries no cards: MPICH's address
    exchange (every host reads every card) misses a key of its all-gather first
    (`launcher.pmi.actions.ALLGATHER_KEY`), so each host fetches every card at once and sends
    no get: MPI_Init's fence, one fetch, MPI_Finalize's fence."""
    job, codes, outputs = run_job([[0, 1], [2, 3], [4, 5]], COLLECTIVES, push_bytes=0)
    assert_world_formed(codes, outputs, 6)
    assert job.events == [] and job.kvs.conflicts == []
    for host in range(3):
        assert [op for h, op in job.sent if h == host] == ["barrier_in", "fetch", "barrier_in"]


def test_two_hosts_form_one_world_over_the_pmi_port_despite_a_forged_client():
    job, codes, outputs = run_job([[0, 1], [2, 3]], COLLECTIVES, port_mode=True,
                                  forged=b"cmd=initack pmiid=777\ncmd=init pmi_version=1\n")
    assert_world_formed(codes, outputs, 4)
    assert [(type(e), e.reason) for e in job.events] == [
        (Close, "unknown or already used PMI_ID")]


def test_mpi_abort_in_one_rank_surfaces_as_abort_with_its_code():
    job, _, _ = run_job([[0], [1]], ABORT)
    assert job.events[0] == Abort(1, 42, "abort")  # MPICH sends "abort" as the message
    assert job.kvs.aborted == (1, 42, "abort")


def test_a_rank_that_dies_before_finalize_is_reported_failed():
    job, codes, _ = run_job([[0], [1]], CRASH)
    assert job.events[0] == RankFailed(1, "closed its PMI connection before finalize")
    assert codes[1] == 3
