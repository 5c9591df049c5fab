"""What an MPICH rank says over PMI-1 in MPI_Init and MPI_Finalize, as one conversation.

The simulated cluster (`testbed.simcluster`) plays it for thousands of fake ranks inside a few
processes; ``python testbed/simrank.py`` plays the same conversation as a real rank process
over its inherited ``PMI_FD`` (the fidelity check against real agents runs it), so both give
the agents and the head the same PMI messages. The order is MPICH's (its PMI-1 client, fd mode:
the rank inherits the socket, no initack): init, get_maxes, get_appnum, get_my_kvsname, the
process mapping, one put of its business card, barrier (the fence), gets of a few peers'
cards, then the barrier and finalize of MPI_Finalize.

Only `os` and `socket` are imported: a real rank's start-up should cost what a small C
program's does, not a Python library's.
"""

from __future__ import annotations

import os
import socket

#: A business card's length (MPICH ch4 over TCP: ~100-200 hex characters); a job may set it
#: (up to PMI's 1,024) with DTRAIN_SIM_CARD_CHARS, read by the fake and the real ranks alike.
CARD_CHARS = int(os.environ.get("DTRAIN_SIM_CARD_CHARS", "200"))
PEER_GETS = 4      # peers' cards each rank reads after the fence (bench.pmi_scaling's choice)
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


class Conversation:
    """One rank's requests in order, each checked against the reply it must get."""

    def __init__(self, rank: int, world: int, gets: int = PEER_GETS) -> None:
        self.rank = rank
        kvs = "{kvs}"  # filled in from get_my_kvsname's reply
        steps: list[tuple[str, str, str]] = [
            ("cmd=init pmi_version=1 pmi_subversion=1", "cmd=response_to_init", ""),
            ("cmd=get_maxes", "cmd=maxes", ""),
            ("cmd=get_appnum", "cmd=appnum", ""),
            ("cmd=get_my_kvsname", "cmd=my_kvsname", ""),
            (f"cmd=get kvsname={kvs} key=PMI_process_mapping", "cmd=get_result rc=0", ""),
            (f"cmd=put kvsname={kvs} key=bc-{rank} value={card(rank)}", "cmd=put_result rc=0",
             ""),
            ("cmd=barrier_in", "cmd=barrier_out", FENCED),
        ]
        for i, peer in enumerate(peers(rank, world, gets)):
            steps.append((f"cmd=get kvsname={kvs} key=bc-{peer}",
                          f"cmd=get_result rc=0 value={card(peer)}",
                          WIRED if i == gets - 1 else ""))
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
    talk = Conversation(rank, world, gets)
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
