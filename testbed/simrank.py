"""What an MPICH rank says over PMI-1 in MPI_Init and MPI_Finalize, as one conversation.

The simulated cluster (`testbed.simcluster`) plays it for thousands of fake ranks inside a few
processes; ``python testbed/simrank.py`` plays the same conversation as a real rank process
over its inherited ``PMI_FD`` (the fidelity check against real agents runs it), so both give
the agents and the head the same PMI messages. The order is MPICH's (its PMI-1 client, fd mode:
the rank inherits the socket, no initack): init, get_maxes, get_appnum, get_my_kvsname, the
process mapping, its address exchange, then the barrier and finalize of MPI_Finalize. The
exchange is one of two:

* light (``hosts`` 0): every rank puts one business card, fences, and reads a few peers' (a
  program that wires up lazily);
* MPICH's default (``hosts`` > 0, ch4's ``MPIR_pmi_allgather_shm``), as traced under Hydra
  ``-verbose`` with this machine's MPICH wheel (2026-11-29, 2-8 hosts x 1-4 ranks): the first
  rank of each host puts the host's card as a key ``-allgather-1-<host>`` = ``segments=9`` and
  9 segment keys of ~560 characters (5 KB), every rank fences, and the first rank of each
  host reads every host's 10 keys (its host's ranks share them through shared memory); the
  other ranks only fence.

Only `os` and `socket` are imported: a real rank's start-up should cost what a small C
program's does, not a Python library's.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

#: A business card's length (MPICH ch4 over TCP: ~100-200 hex characters); a job may set it
#: (up to PMI's 1,024) with DTRAIN_SIM_CARD_CHARS, read by the fake and the real ranks alike.
CARD_CHARS = int(os.environ.get("DTRAIN_SIM_CARD_CHARS", "200"))
PEER_GETS = 4      # peers' cards each rank reads after the fence (bench.pmi_scaling's choice)
#: MPICH's exchange: the segments of a host's card and each one's length (the last is shorter in
#: MPICH; here all are full, 5,040 characters a host against the 4,930-5,070 traced).
SEGMENTS, SEGMENT_CHARS = 9, 560
#: The address exchanges a job's ranks may play (DTRAIN_SIM_EXCHANGE), the default first.
EXCHANGES = ("light", "mpich")
#: Step names the timestamps are taken at (`Conversation.marks`): past MPI_Init's fence,
#: past the gets (wired up), past finalize.
FENCED, WIRED, FINALIZED = "fenced", "wired", "finalized"


def card(rank: int) -> str:
    """Rank ``rank``'s business card: ``CARD_CHARS`` characters that name the rank."""
    return (f"{rank:08x}" * (CARD_CHARS // 8 + 1))[:CARD_CHARS]


def peers(rank: int, world: int, gets: int = PEER_GETS) -> list[int]:
    """The ranks whose cards ``rank`` reads: spread over the world, never itself if avoidable."""
    if world <= 1:
        return []
    return [(rank + 1 + (i * world) // max(gets, 1)) % world for i in range(gets)]


def _hex(seed: int, chars: int) -> str:
    """``chars`` pseudo-random hex digits from ``seed`` (a 64-bit LCG: no imports)."""
    out, x = [], seed * 6364136223846793005 + 1442695040888963407
    for _ in range(-(-chars // 16)):
        x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        out.append(f"{x:016x}")
    return "".join(out)[:chars]


def _shared(index: int) -> str:
    """What segment ``index`` of every host's card has in common (made once a process)."""
    made = _SHARED.get(index)
    if made is None:
        made = _SHARED[index] = _hex(index, SEGMENT_CHARS)
    return made


#: Segments made so far: a simulator process's ranks read the same hosts' cards, and making
#: them again was ~6% of its CPU in MPICH's exchange at 1,024 hosts (yappi, 2026-11-30).
_SEGMENTS: dict[tuple[int, int], str] = {}
_SHARED: dict[int, str] = {}


def segment(host: int, index: int) -> str:
    """Segment ``index`` (1-based) of host ``host``'s card in MPICH's exchange. As compressible
    as MPICH's: its cards are run-length-encoded hex whose structure every host shares, with
    each host's addresses in it (zlib's fastest level shrinks the traced ones 4.2x); here of
    every 40 characters 30 are the segment's, the same on every host, and 10 the host's own
    (4.1x over 256 hosts' cards)."""
    made = _SEGMENTS.get((host, index))
    if made is None:
        shared = _shared(index)
        own = _hex((host + 1) << 8 | index, SEGMENT_CHARS // 4)
        made = _SEGMENTS[host, index] = "".join(shared[i:i + 30] + own[i // 4:i // 4 + 10]
                                                for i in range(0, SEGMENT_CHARS, 40))
    return made


def host_card(host: int) -> list[tuple[str, str]]:
    """Host ``host``'s card in MPICH's exchange: its 10 keys and values, in MPICH's order."""
    name = f"-allgather-1-{host}"
    return [(name, f"segments={SEGMENTS}"), *(
        (f"{name}-seg-{i}/{SEGMENTS}", segment(host, i)) for i in range(1, SEGMENTS + 1))]


def exchange_hosts(env: Mapping[str, str], exchange: str | None) -> int:
    """The ``hosts`` of a rank's `Conversation`: under MPICH's exchange the job's hosts, read
    from the rank's environment ``env``, else 0 (the light one). ``exchange``: the job's
    DTRAIN_SIM_EXCHANGE (`EXCHANGES`; None, the default)."""
    if (exchange or EXCHANGES[0]) != "mpich":
        return 0
    return int(env.get("GROUP_WORLD_SIZE") or 1)


class Conversation:
    """One rank's requests in order, each checked against the reply it must get.

    ``gets``: in the light exchange the peers whose cards the rank reads; in MPICH's
    (``hosts`` > 0, ranks placed host by host) the hosts whose cards a host's first rank reads,
    spread over the job (every host's when ``gets`` >= ``hosts``; the benches read fewer where
    simulating every read would take the simulator minutes: a host's first miss fetches every
    card at once and it reads the rest from its own cache, `launcher.pmi.proxy`).
    """

    def __init__(self, rank: int, world: int, gets: int = PEER_GETS, *, hosts: int = 0) -> None:
        self.rank = rank
        kvs = "{kvs}"  # filled in from get_my_kvsname's reply
        steps: list[tuple[str, str, str]] = [
            ("cmd=init pmi_version=1 pmi_subversion=1", "cmd=response_to_init", ""),
            ("cmd=get_maxes", "cmd=maxes", ""),
            ("cmd=get_appnum", "cmd=appnum", ""),
            ("cmd=get_my_kvsname", "cmd=my_kvsname", ""),
            (f"cmd=get kvsname={kvs} key=PMI_process_mapping", "cmd=get_result rc=0", ""),
        ]
        if hosts:
            per_host = max(world // hosts, 1)
            host, first = rank // per_host, rank % per_host == 0
            puts = host_card(host) if first else []
            reads = [kv for peer in (peers(host, hosts, min(gets, hosts)) if first else [])
                     for kv in host_card(peer)]
        else:
            puts = [(f"bc-{rank}", card(rank))]
            reads = [(f"bc-{peer}", card(peer)) for peer in peers(rank, world, gets)]
        steps += [(f"cmd=put kvsname={kvs} key={key} value={value}", "cmd=put_result rc=0", "")
                  for key, value in puts]
        steps.append(("cmd=barrier_in", "cmd=barrier_out", FENCED))
        for i, (key, value) in enumerate(reads):
            steps.append((f"cmd=get kvsname={kvs} key={key}", f"cmd=get_result rc=0 value={value}",
                          WIRED if i == len(reads) - 1 else ""))
        steps += [("cmd=barrier_in", "cmd=barrier_out", ""),
                  ("cmd=finalize", "cmd=finalize_ack", FINALIZED)]
        self._steps = steps
        self.step = 0
        self.kvsname = ""
        self.marks: list[str] = []  # the mark of each step answered, in order (for stamps)
        self._inbox = b""

    @property
    def done(self) -> bool:
        return self.step == len(self._steps)

    def request(self) -> bytes:
        """The next request line."""
        return (self._steps[self.step][0].replace("{kvs}", self.kvsname) + "\n").encode()

    def feed(self, data: bytes) -> str | None:
        """Bytes from the agent; when they complete the reply to the current request, check it
        and move on: returns the step's mark ("" for none), else None (wait for more).
        Raises RuntimeError on a wrong reply (the simulated rank fails, as MPICH would)."""
        self._inbox += data
        if b"\n" not in self._inbox:
            return None
        line, _, self._inbox = self._inbox.partition(b"\n")
        text = line.decode()
        _, want, mark = self._steps[self.step]
        if not text.startswith(want) or "rc=0" not in text and "cmd=finalize_ack" not in text:
            raise RuntimeError(f"rank {self.rank} step {self.step}: got {text[:120]!r}, "
                               f"wanted {want[:120]!r}")
        if want == "cmd=my_kvsname":
            self.kvsname = text.split("kvsname=", 1)[1].split()[0]
        self.step += 1
        self.marks.append(mark)
        return mark


def main() -> int:
    """A real rank: the conversation over the inherited PMI_FD, then exit 0; with
    DTRAIN_SIM_STAMPS set, its stamps as JSON in that folder (as `testbed.simcluster` keeps
    them for a fake rank)."""
    import time

    running = time.monotonic()
    rank, world = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    gets = int(os.environ.get("DTRAIN_SIM_GETS", PEER_GETS))
    sock = socket.socket(fileno=int(os.environ["PMI_FD"]))
    talk = Conversation(rank, world, gets,
                        hosts=exchange_hosts(os.environ, os.environ.get("DTRAIN_SIM_EXCHANGE")))
    stamps: dict[str, float] = {}
    while not talk.done:
        sock.sendall(talk.request())
        mark = None
        while mark is None:  # one reply per request: MPICH waits for each
            data = sock.recv(65536)
            if not data:
                raise SystemExit(f"rank {rank}: the agent closed PMI")
            mark = talk.feed(data)
        if mark:
            stamps[mark] = time.monotonic()
    sock.close()
    if folder := os.environ.get("DTRAIN_SIM_STAMPS"):
        import json

        with open(os.path.join(folder, f"rank{rank}.json"), "w") as out:
            json.dump({"host": os.environ.get("GROUP_RANK", ""), "rank": rank,
                       "running": running, **stamps, "exit": time.monotonic(), "code": 0}, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
