"""PMI wire-up at scale: simulated MPICH clients against the per-host proxies and the head.

Every rank runs the sequence MPICH's PMI-1 client runs in MPI_Init (PMI_PORT mode):
initack, init, get_maxes, get_appnum, get_my_kvsname, get PMI_process_mapping, one put of its
business card, barrier, a few gets of other ranks' cards, then the barrier and finalize of
MPI_Finalize. Ranks sit 8 to a host; one PmiProxy per host, one KeyValueSpace for the head.

Two drivers: ``cores`` calls the pure cores directly (the protocol's own cost), ``sockets``
puts a real socketpair between each simulated client and its proxy and serves them all from
one selector loop (adds the system calls an agent makes). Both run every host in this one
process, so the times are the sum over all hosts: an upper bound for the real, parallel job.
Relay messages go between proxies and the head as dicts; ``head_mib_out_max_barrier`` is what
the head's barrier_out messages of the heaviest barrier would weigh as JSON on the SSH
channels: every host receives every card once, so it grows as hosts x ranks x card size.

    python -m bench.pmi_scaling            # 64, 256, 1024, 4096 ranks
    python -m bench.pmi_scaling 1024 8192
"""

from __future__ import annotations

import argparse
import json
import resource
import selectors
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from launcher.pmi import (
    KeyValueSpace,
    PmiProxy,
    Reply,
    Send,
    format_reply,
)

SIZES = (64, 256, 1024, 4096)
RANKS_PER_HOST = 8
CARD_CHARS = 200          # hex business card (MPICH ch4 with UCX puts ~2 KB in segments)
PEER_GETS = 4             # cards each rank fetches after the barrier
KVSNAME = "kvs_bench"


def _card(rank: int) -> str:
    return (f"{rank:08x}" * (CARD_CHARS // 8 + 1))[:CARD_CHARS]


@dataclass
class _Client:
    """One simulated rank: its request lines and the reply each one must get."""

    rank: int
    host: int
    lines: list[bytes]
    expected: list[bytes]
    step: int = 0
    inbox: bytearray = field(default_factory=bytearray)

    @property
    def done(self) -> bool:
        return self.step == len(self.lines)

    def check(self, data: bytes) -> None:
        want = self.expected[self.step]
        if not data.startswith(want):
            raise RuntimeError(f"rank {self.rank} step {self.step}: got {data[:80]!r}, "
                               f"wanted {want[:80]!r}")
        self.step += 1


def _script(rank: int, world: int, token: str) -> tuple[list[bytes], list[bytes]]:
    peers = [(rank + world // (i + 2) + i) % world for i in range(PEER_GETS)]
    steps = [
        (f"cmd=initack pmiid={token}", "cmd=initack rc=0\n"),
        ("cmd=init pmi_version=1 pmi_subversion=1", "cmd=response_to_init rc=0"),
        ("cmd=get_maxes", "cmd=maxes rc=0"),
        ("cmd=get_appnum", "cmd=appnum rc=0"),
        ("cmd=get_my_kvsname", f"cmd=my_kvsname rc=0 kvsname={KVSNAME}\n"),
        (f"cmd=get kvsname={KVSNAME} key=PMI_process_mapping", "cmd=get_result rc=0 value=("),
        (f"cmd=put kvsname={KVSNAME} key=bc-{rank} value={_card(rank)}", "cmd=put_result rc=0"),
        ("cmd=barrier_in", "cmd=barrier_out rc=0"),
    ]
    steps += [(f"cmd=get kvsname={KVSNAME} key=bc-{p}",
               format_reply("get_result", rc=0, value=_card(p)).decode()) for p in peers]
    steps += [("cmd=barrier_in", "cmd=barrier_out rc=0"), ("cmd=finalize", "cmd=finalize_ack")]
    return [(q + "\n").encode() for q, _ in steps], [a.encode() for _, a in steps]


class _Job:
    """Proxies, head and clients of one simulated job, plus the head's message counters."""

    def __init__(self, world: int) -> None:
        hosts = (world + RANKS_PER_HOST - 1) // RANKS_PER_HOST
        per_host = [list(range(h * RANKS_PER_HOST, min(world, (h + 1) * RANKS_PER_HOST)))
                    for h in range(hosts)]
        mapping = f"(vector,(0,{hosts},{RANKS_PER_HOST}))"
        self.kvs = KeyValueSpace(hosts=hosts, kvsname=KVSNAME)
        self.proxies, self.clients = [], {}
        for host, ranks in enumerate(per_host):
            tokens = {str(1000003 * (r + 1) % 2147483647): r for r in ranks}
            self.proxies.append(PmiProxy(ranks=ranks, world_size=world, kvsname=KVSNAME,
                                         process_mapping=mapping, id_tokens=tokens))
            for token, rank in tokens.items():
                lines, expected = _script(rank, world, token)
                self.clients[rank + 1] = _Client(rank, host, lines, expected)  # conn = rank + 1
        self.hosts, self.head_in, self.head_out, self.gets_upstream = hosts, 0, 0, 0
        self.head_bytes_max = 0  # JSON bytes the head sends for its largest barrier

    def apply(self, host: int, actions: list, on_reply) -> None:
        broken = [a for a in actions if not isinstance(a, (Reply, Send))]
        if broken:  # Close, RankFailed or Abort: a simulated client broke the protocol
            raise RuntimeError(f"simulated client rejected: {broken}")
        for action in actions:
            if isinstance(action, Reply):
                on_reply(action.conn, action.data)
            else:
                self._relay(host, action.msg, on_reply)

    def _relay(self, host: int, msg: dict, on_reply) -> None:
        self.head_in += 1
        self.gets_upstream += msg["op"] == "get"
        replies = self.kvs.handle(host, msg)
        self.head_out += len(replies)
        if replies and replies[0][1]["op"] == "barrier_out":
            size = len(json.dumps(replies[0][1])) * len(replies)
            self.head_bytes_max = max(self.head_bytes_max, size)
        for dest, reply in replies:
            self.apply(dest, self.proxies[dest].upstream(reply), on_reply)

    def result(self, mode: str, seconds: float) -> dict:
        barriers = self.kvs.epoch
        return {
            "ranks": len(self.clients), "hosts": self.hosts, "mode": mode,
            "seconds": round(seconds, 4), "barriers": barriers,
            "head_msgs_per_barrier": (self.head_in + self.head_out) / max(barriers, 1),
            "upstream_gets": self.gets_upstream,
            "head_mib_out_max_barrier": round(self.head_bytes_max / 2**20, 2),
        }


def run_cores(world: int) -> dict:
    """Drive the cores directly: a ready queue of ranks whose last request was answered."""
    job = _Job(world)
    ready = deque(job.clients)
    start = time.perf_counter()
    for conn, client in job.clients.items():
        job.proxies[client.host].open(conn, None)

    def on_reply(conn: int, data: bytes) -> None:
        client = job.clients[conn]
        client.check(data)
        if not client.done:
            ready.append(conn)

    while ready:
        conn = ready.popleft()
        client = job.clients[conn]
        job.apply(client.host, job.proxies[client.host].feed(conn, client.lines[client.step]),
                  on_reply)
    return job.result("cores", time.perf_counter() - start)


def run_sockets(world: int) -> dict:
    """The same clients behind real socketpairs, one selector loop serving both ends."""
    _raise_fd_limit(2 * world + 64)
    job = _Job(world)
    sel = selectors.DefaultSelector()
    pairs: dict[int, tuple[socket.socket, socket.socket]] = {}
    try:
        start = time.perf_counter()
        for conn, client in job.clients.items():
            server, ours = socket.socketpair()
            pairs[conn] = (server, ours)
            sel.register(server, selectors.EVENT_READ, ("proxy", conn))
            sel.register(ours, selectors.EVENT_READ, ("client", conn))
            job.proxies[client.host].open(conn, None)
            ours.sendall(client.lines[0])
        _serve(job, sel, pairs)
        return job.result("sockets", time.perf_counter() - start)
    finally:
        sel.close()
        for server, ours in pairs.values():
            server.close()
            ours.close()


def _serve(job: _Job, sel: selectors.BaseSelector, pairs: dict) -> None:
    def on_reply(conn: int, data: bytes) -> None:
        pairs[conn][0].sendall(data)

    remaining = len(job.clients)
    while remaining:
        for key, _ in sel.select(timeout=10):
            side, conn = key.data
            client = job.clients[conn]
            data = key.fileobj.recv(65536)
            if side == "proxy":
                job.apply(client.host, job.proxies[client.host].feed(conn, data), on_reply)
                continue
            client.inbox += data
            lines_wanted = 4 if client.step == 0 else 1  # initack comes with three set lines
            if client.inbox.count(b"\n") < lines_wanted:
                continue
            client.check(bytes(client.inbox))
            client.inbox.clear()
            if client.done:
                remaining -= 1
            else:
                key.fileobj.sendall(client.lines[client.step])


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise RuntimeError(f"needs {needed} open files, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def run(sizes=SIZES) -> list[dict]:
    """One row per size and driver (for a bench runner)."""
    rows = []
    for world in sizes:
        rows.append(run_cores(world))
        try:
            rows.append(run_sockets(world))
        except (RuntimeError, OSError) as exc:
            rows.append({"ranks": world, "mode": "sockets", "skipped": str(exc)})
    return rows


def _table(rows: list[dict]) -> str:
    head = (f"{'ranks':>6} {'hosts':>5} {'driver':>8} {'wire-up s':>10} {'barriers':>8} "
            f"{'head msgs/barrier':>17} {'upstream gets':>13} {'head MiB out, max':>17}")
    out = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            out.append(f"{r['ranks']:>6} {'':>5} {r['mode']:>8}  skipped: {r['skipped']}")
            continue
        out.append(f"{r['ranks']:>6} {r['hosts']:>5} {r['mode']:>8} {r['seconds']:>10.3f} "
                   f"{r['barriers']:>8} {r['head_msgs_per_barrier']:>17.0f} "
                   f"{r['upstream_gets']:>13} {r['head_mib_out_max_barrier']:>17.2f}")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pmi_scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ranks", type=int, nargs="*", help=f"rank counts (default {SIZES})")
    sizes = tuple(ap.parse_args(argv).ranks) or SIZES
    print(f"PMI-1 wire-up, {RANKS_PER_HOST} ranks per host, {CARD_CHARS}-char cards, "
          f"{PEER_GETS} peer gets per rank; all hosts simulated in one process")
    print(_table(run(sizes)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
