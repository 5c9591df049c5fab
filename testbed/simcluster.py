"""A simulated cluster: tens of hosts' agents in one process, fake ranks that speak PMI-1.

``python -m testbed.simcluster --stats FILE`` listens on a loopback port (printed as its first
line of stdout) and serves every TCP connection to it as one host: the connection's first line
names the host, then it carries the head's frames exactly as an SSH channel would. Each host is
the real agent (`launcher.agent.main.Agent` with its `HeadLink`, `FrameWriter`, `PmiSockets`,
`PmiProxy` and, when the head sends it a SUBTREE, its `launcher.tree.relay.Relay`), run as
`launcher.agent.serve.run` runs it. What is simulated is below the agent, in the host adapter
it takes (`launcher.agent.host.Host`; here `SimHost`, one per simulated host):

* ranks: `start_rank` takes the rank's end of its PMI_FD socket pair, as a forked rank would
  inherit it, and hands it to one `FakeRanks` thread per process, which plays MPICH's PMI-1
  conversation (`testbed.simrank`) for every rank of every host here, then "exits" (the
  agent's queue gets `RankExited`, as from its reaper thread). A KILL or BYE ends a fake rank
  like a signal (exit 128+sig).
* the ranks' /proc readings (`stat`): a fake rank has no process of its own (its pid is this
  process's, shared by thousands), so the reading says "running, CPU unknown", as for a pid
  that cannot be read; the records themselves and their PROGRESS frames are unchanged.
* the host's /dev/shm (`records_folder`): a real agent keeps its ranks' progress records in a
  folder there and first sweeps away what dead agents of the host left. Simulated hosts would
  all share one /dev/shm, so each sweep would read every other host's folder: O(hosts) per
  host, O(hosts^2) here, for a handful of entries on a real host. Here the folders go to a
  private temporary folder of this process (removed at its end), with no sweep.
* the host's process tree (`kill_strays`, `signal_descendants`): every simulated host shares
  one process, which has no children, so there is nothing to walk.
* decoding a fetch's answer (`share_decodes`): every host gets the same bytes (every card of
  the job, 5.5 MB of JSON for MPICH's exchange at 1,024 hosts) and each real host decodes them
  on its own cores, in parallel with the others (~0.1-0.2 s). Here the hosts of one process
  would decode them one after another under one interpreter lock, ~64 x that per process, and
  the simulated hosts starved of CPU missed their heartbeats: one decode serves them all.
* a relay's hops (`connect_child`): a relay reaches a host below it as the head reaches the
  hosts it starts, a TCP connection to the simcluster port its SUBTREE hop names
  (`testbed.simhead.describe_sim`), so a tree launch's relays are real agents too.

The process exits when its stdin closes (the bench or test that started it is done or dead)
and then writes, as JSON to ``--stats``, every fake rank's timestamps (CLOCK_MONOTONIC, which
every process of the machine shares): running, fenced (past MPI_Init's fence), wired (past its
gets), finalized, exit, and its exit code, and every agent's exit code, and the process's
CPU (user and system) and context switches (`usage`).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from testbed.simrank import PEER_GETS, Conversation, exchange_hosts

#: A thread's stack here: 4 threads per simulated host (agent loop, head reader, frame
#: writer, PMI selector; a relay one more per child) x 1,000 hosts would reserve 8 GiB of
#: address space at the default.
STACK_BYTES = 512 * 1024
#: The interpreter's switch interval here (Python's default: 5 ms). A real agent is a process
#: of a few threads on its own host; here 64 hosts' few hundred threads share one interpreter
#: lock, and whenever many have work at once (a fence's answer, MPICH's cards arriving at every
#: host) each waiter woke every 5 ms to ask the holder to let go: at 1,024 hosts in MPICH's
#: exchange 8.7 million context switches and 89 s of the simulator's CPU (58 s in the kernel)
#: for the cards' 1.3 GB, against 0.43 million and 23 s at 0.2 s, and the hosts wired in 15 s
#: instead of 51 (`bench.sim_scale`, 2026-11-29). Forcing turns between simulated hosts only
#: costs: each would run on cores of its own.
SWITCH_INTERVAL_S = 0.2
#: How long the simulator waits, once the head has returned, for its agents to leave.
LEAVE_S = 30.0
#: Set (to anything) by a bench: run the simulation at SCHED_IDLE (`yield_to_head`).
IDLE_VARIABLE = "DTRAIN_SIM_IDLE"


@dataclass
class RankStamps:
    host: str
    rank: int
    running: float
    marks: dict[str, float] = field(default_factory=dict)
    exit: float = 0.0
    code: int | None = None


class FakeRanks:
    """One thread plays every fake rank of this process over its PMI socket."""

    def __init__(self, gets: int = PEER_GETS, exchange: str | None = None) -> None:
        self.gets, self.exchange = gets, exchange  # what every fake rank here plays
        self.stamps: list[RankStamps] = []
        self._sel = selectors.DefaultSelector()
        self._todo: queue.Queue[tuple[str, Any, int]] = queue.Queue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        threading.Thread(target=self._loop, name="fake-ranks", daemon=True).start()

    def add(self, rank: FakeRank) -> None:
        self._post("add", rank, 0)

    def kill(self, rank: FakeRank, sig: int) -> None:
        self._post("kill", rank, sig)

    def _post(self, what: str, rank: FakeRank, sig: int) -> None:
        self._todo.put((what, rank, sig))
        self._wake_w.send(b"x")

    def _loop(self) -> None:
        while True:
            for key, _ in self._sel.select():
                if key.data is None:
                    self._wake_r.recv(4096)
                    self._drain()
                else:
                    self._readable(key.data)

    def _drain(self) -> None:
        while not self._todo.empty():
            what, rank, sig = self._todo.get()
            if what == "add":
                rank.stamps = RankStamps(rank.host, rank.rank, time.monotonic())
                self.stamps.append(rank.stamps)
                self._sel.register(rank.sock, selectors.EVENT_READ, rank)
                self._send(rank)
            elif rank.stamps is not None and rank.stamps.code is None:
                self._end(rank, 128 + sig, sig)  # the signal ends it wherever it was
            elif rank.stamps is None:
                rank.killed = sig  # killed before its watch: it ends as soon as it is added

    def _readable(self, rank: FakeRank) -> None:
        if rank.stamps is None or rank.stamps.code is not None:
            return  # ended earlier in this round of the loop (a kill)
        try:
            data = rank.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._end(rank, 1, None)  # the agent closed PMI under the rank: MPICH aborts
            return
        try:
            mark = rank.talk.feed(data)
        except RuntimeError as exc:
            sys.stderr.write(f"simcluster: {exc}\n")
            self._end(rank, 1, None)
            return
        if mark is None:
            return
        if mark:
            assert rank.stamps is not None
            rank.stamps.marks[mark] = time.monotonic()
        if rank.talk.done:
            self._end(rank, 0, None)
        else:
            self._send(rank)

    def _send(self, rank: FakeRank) -> None:
        if rank.killed:
            self._end(rank, 128 + rank.killed, rank.killed)
            return
        try:
            rank.sock.sendall(rank.talk.request())
        except OSError:
            self._end(rank, 1, None)

    def _end(self, rank: FakeRank, code: int, sig: int | None) -> None:
        from launcher.agent.ranks import RankExited

        assert rank.stamps is not None
        if rank.stamps.code is not None:
            return  # once only
        self._sel.unregister(rank.sock)
        rank.sock.close()  # as a process's exit closes its PMI socket, before the reaper
        rank.stamps.exit, rank.stamps.code = time.monotonic(), code
        assert rank.events is not None
        rank.events.put(RankExited(rank.rank, code, sig))


def _fake_rank_class() -> type:
    """`FakeRank`: a `RankProcess` whose process is a conversation (imported lazily, so this
    module's import does not pull the agent into the head's process)."""
    from launcher.agent.ranks import RankProcess
    from records import field as record_field

    class Fake(RankProcess):  # a record, as the agent's RankProcess
        host: str = ""
        sock: socket.socket = record_field(default_factory=socket.socket)
        talk: Conversation = record_field(default_factory=lambda: Conversation(0, 1))
        driver: FakeRanks | None = None
        events: queue.Queue[Any] | None = None
        stamps: RankStamps | None = None
        killed: int = 0

        def watch(self, on_output: Callable[[int, int, bytes], object],
                  events: queue.Queue[Any]) -> None:
            self.events = events
            assert self.driver is not None
            self.driver.add(self)

        def signal_group(self, sig: int) -> None:
            if sig == signal.SIGCONT:
                return
            self.sent.append((sig, time.monotonic()))
            # A group already gone takes no signal (`killpg`'s ESRCH): the agent's SIGKILL of
            # each exited rank's leftovers costs the fake ranks' thread nothing, as the kernel
            # nothing. Its code is set before the agent hears of its exit (`FakeRanks._end`).
            ended = self.stamps is not None and self.stamps.code is not None
            if self.driver is not None and self.events is not None and not ended:
                self.driver.kill(self, sig)

    return Fake


FakeRank: Any = None  # set by `sim_host_class` (the class needs the agent's modules)


class _FakeProc:
    """What the agent reads of a rank's Popen: its pid (this process's: it exists, so the
    agent's progress readings find a live process) and rank 0's stdin."""

    def __init__(self, stdin: Any) -> None:
        self.pid = os.getpid()
        self.stdin = stdin


def sim_host_class() -> type:
    """`SimHost`: the agent's `launcher.agent.host.Host` for one simulated host of this
    process (imported lazily, as `FakeRank`): its ranks are conversations played by
    ``driver``, its /proc reading says "running, CPU unknown", its records' folder is in this
    process's private folder with nothing to sweep, and it has no stray processes."""
    global FakeRank
    from launcher.agent.host import Host

    FakeRank = FakeRank or _fake_rank_class()

    class SimHost(Host):
        def __init__(self, name: str, driver: FakeRanks, records: str) -> None:
            self.name, self.driver, self.records = name, driver, records

        def start_rank(self, rank: int, argv: Sequence[str], env: Mapping[str, str],
                       cwd: str, pass_fds: Sequence[int], stdin_pipe: bool = False) -> Any:
            world = int(env.get("PMI_SIZE") or env.get("WORLD_SIZE") or 1)
            # The rank's own copy of its socket end, as fork would give it: the agent closes
            # its copy of the child end right after this returns (PmiSockets.started).
            sock = socket.socket(fileno=os.dup(pass_fds[0]))
            sock.setblocking(True)
            stdin = open(os.devnull, "wb") if stdin_pipe else None  # noqa: SIM115 (rank 0's)
            return FakeRank(rank, _FakeProc(stdin), host=self.name, sock=sock,
                            talk=Conversation(rank, world, self.driver.gets,
                                              hosts=exchange_hosts(env, self.driver.exchange)),
                            driver=self.driver)

        def stat(self, pid: int | None) -> tuple[str, float | None, bool]:
            return "running", None, False

        def records_folder(self, job_id: str) -> str:
            import tempfile

            return tempfile.mkdtemp(prefix=f"{self.name}-{job_id}-", dir=self.records)

        def kill_strays(self, keep: frozenset[int] = frozenset(), *,
                        reaping: bool = True) -> None:
            pass

        def signal_descendants(self, sig: int, keep: frozenset[int] = frozenset()
                               ) -> list[Any]:
            return []

    return SimHost


class _Conn:
    """The agent's stream: the connection's bytes after the host's name line."""

    def __init__(self, sock: socket.socket, rest: bytes) -> None:
        self.sock, self.rest = sock, rest

    def read(self, size: int) -> bytes:
        if self.rest:
            data, self.rest = self.rest, b""
            return data
        try:
            return self.sock.recv(size)
        except OSError:
            return b""

    def write(self, data: memoryview) -> int:
        return self.sock.send(data)


def connect_child(node: dict[str, Any]) -> Any:
    """A relay's stream to a host below it (`launcher.tree.relay.Relay`'s ``connect``): the
    simcluster port its SUBTREE hop names (`testbed.simhead.describe_sim`), as the head
    reaches the hosts it starts."""
    from testbed.simhead import SimAgentStream

    return SimAgentStream(str(node["name"]), int(node["hop"]["port"]))


def run_agent(link: Callable[[Any], Any], host: Any) -> int:
    """The real agent of one simulated host, run as `launcher.agent.serve` runs it (a relay
    when the head says SUBTREE, its children reached by `connect_child`)."""
    from launcher.agent import serve
    from launcher.agent.main import Agent

    return serve.run(Agent(link, relay_connect=connect_child, host=host))


#: host -> when its connection was closed after its agent's run returned (CLOCK_MONOTONIC):
#: the exit tail's "agents leaving" part, host by host.
LEFT: dict[str, float] = {}


def serve_host(sock: socket.socket, hosts: Callable[[str], Any], codes: dict[str, int]) -> None:
    """One simulated host: its name, then the real agent over the connection."""
    from launcher.agent.head_link import HeadLink

    header = b""
    while b"\n" not in header:
        chunk = sock.recv(4096)
        if not chunk:
            sock.close()
            return
        header += chunk
    name, _, rest = header.partition(b"\n")
    host = name.decode()
    conn = _Conn(sock, rest)
    codes[host] = run_agent(lambda events: HeadLink(events, conn.read, conn), hosts(host))
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
    LEFT[host] = time.monotonic()


def yield_to_head() -> None:
    """Run this process's threads (made after this call: they inherit it) at SCHED_IDLE: the
    head stands for a machine of its own, but here it shares the cores with thousands of
    simulated agents' threads, and the kernel weighs every thread alike. At 1,024 hosts in
    the CPU cgroup the head's start of its 1,024 links (a reader thread each: `Thread.start`
    waits until the new thread has run) took 10 s of wall time for a fraction of a second of
    CPU, and at 4,096 hosts it outlasted the 60 s an agent waits for its SPEC
    (`launcher.agent.main.HELLO_SILENCE_S`). Lowering only ever yields: nobody else loses.
    Only for benches (`IDLE_VARIABLE`): a test's simulation at SCHED_IDLE among the suite's
    parallel tests gets next to no CPU (256 hosts: 20 s alone, 200 s beside 3 busy loops)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux: the simulation just runs at equal weight
        pass


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def preload() -> None:
    """Import what every simulated host's agent runs before listening, not when the first
    host connects: on real hosts each agent's imports run on its own host, in parallel, while
    here one process's imports serve its tens of hosts, and on shared cores the imports of
    64 processes (4,096 hosts) would sit on the launch's critical path one after another."""
    import launcher.agent.head_link
    import launcher.agent.pmi_sockets
    import launcher.agent.serve
    import launcher.tree.relay  # noqa: F401 (a relay's, when the head sends SUBTREE)


#: A PMI frame this long or longer is decoded once per process (`share_decodes`).
SHARED_DECODE_BYTES = 1 << 16


def share_decodes() -> None:
    """One decode of a large PMI frame serves every simulated host of this process that gets
    the same bytes (see the module): `wire.Frame.json` is wrapped so; its readers only read
    the object (the proxy and a relay copy the cards into their own caches)."""
    from launcher import wire

    decode = wire.Frame.json
    lock = threading.Lock()
    # The latest large payload and its object: a job has one answer per fence. Compared, not
    # hashed: each host's copy is a new bytes object, and hashing 1.3 MB (1,024 hosts) for
    # each one cost more than the comparison, which stops at the first difference.
    latest: list[tuple[bytes, dict[str, Any]]] = []

    def json_once(frame: wire.Frame) -> dict[str, Any]:
        if frame.kind is not wire.Kind.PMI or len(frame.payload) < SHARED_DECODE_BYTES:
            return decode(frame)
        # Decoded under the lock: the hosts that get the same answer meanwhile wait for this
        # decode instead of each making its own. Checked and decoded apart, 11-17 of a
        # process's 64 hosts decoded the 5.5 MB of cards themselves (MPICH's exchange at 1,024
        # hosts, 2026-11-30): the GIL runs one decode at a time anyway.
        with lock:
            if latest and latest[0][0] == frame.payload:
                return latest[0][1]
            hit = decode(frame)
            latest[:] = [(frame.payload, hit)]
            return hit

    wire.Frame.json = json_once


def usage() -> dict[str, float]:
    """This process's CPU (user + system, and each), peak RSS and context switches: the
    system time and the switches are what its threads' hand-offs cost beyond Python's work."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": use.ru_utime + use.ru_stime, "user_s": use.ru_utime,
            "sys_s": use.ru_stime, "maxrss_kib": use.ru_maxrss,
            "switches": use.ru_nvcsw + use.ru_nivcsw, "forced_switches": use.ru_nivcsw}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.simcluster")
    ap.add_argument("--stats", required=True, help="where to write the stamps at the end")
    ap.add_argument("--gets", type=int, default=PEER_GETS, help="peer cards each rank reads")
    ap.add_argument("--join", help="HOST:PORT of a rendezvous head: join it instead of waiting")
    ap.add_argument("--token-file", help="the rendezvous token (with --join)")
    ap.add_argument("--names", default="", help="with --join: the hosts' names, comma-separated")
    ap.add_argument("--join-timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    raise_fd_limit()
    if os.environ.get(IDLE_VARIABLE):
        yield_to_head()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    threading.stack_size(STACK_BYTES)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the head decides, as for a real agent
    driver = FakeRanks(args.gets, os.environ.get("DTRAIN_SIM_EXCHANGE"))
    records = tempfile.mkdtemp(prefix="dtrain-simshm-")
    sim_host = sim_host_class()
    preload()
    share_decodes()

    def hosts(name: str) -> Any:
        return sim_host(name, driver, records)

    codes: dict[str, int] = {}
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4096)

    served: list[threading.Thread] = []  # a thread per host, its agent's whole run

    def accept() -> None:
        while True:
            sock, _ = listener.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            served.append(threading.Thread(target=serve_host, args=(sock, hosts, codes),
                                           daemon=True))
            served[-1].start()

    threading.Thread(target=accept, name="accept", daemon=True).start()
    if args.join:
        from testbed.simjoin import join_host, use_named_sockets

        use_named_sockets()
        host, _, port = args.join.rpartition(":")
        for name in args.names.split(","):
            served.append(threading.Thread(target=join_host, args=(
                name, (host, int(port)), args.token_file, hosts, codes, args.join_timeout),
                daemon=True))
            served[-1].start()
    sys.stdout.write(f"{listener.getsockname()[1]}\n")
    sys.stdout.flush()
    sys.stdin.buffer.read()  # until whoever started us closes our stdin (or dies)
    # The head has returned, so every agent got its BYE, but a starved process (a loaded
    # machine: a test's neighbours) may not have run their ends yet: a host whose agent is
    # still leaving would be missing from the codes (seen in a test under load, 2026-11-30).
    deadline = time.monotonic() + LEAVE_S
    for thread in list(served):
        thread.join(max(0.0, deadline - time.monotonic()))
    stamps = [{"host": s.host, "rank": s.rank, "running": s.running, **s.marks, "exit": s.exit,
               "code": s.code} for s in list(driver.stamps)]
    shutil.rmtree(records, ignore_errors=True)
    # Copies taken at once (a dict's copy holds the interpreter lock): agents still leaving
    # change theirs meanwhile, and json.dump lets other threads run between its pieces.
    with open(args.stats, "w") as out:
        json.dump({"ranks": stamps, "agents": dict(codes), "left": dict(LEFT),
                   "pid": os.getpid(), **usage()}, out)
    os._exit(0)


if __name__ == "__main__":  # the module's state lives in testbed.simcluster, not in __main__
    from testbed import simcluster

    sys.exit(simcluster.main())
