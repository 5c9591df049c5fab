"""Each rank's record of its write, left in the save's temporary folder for the leader
(`trainer.checkpoint.save`): its files' sizes and checksums, what they hold, whether it
fsynced them, its share of the values the ranks agree on (`Save.checks`) and its clocks.

A record appears whole or not at all (written under a hidden name, then renamed), and only
after the rank's tensor file is written, so the leader may take the records as they appear
while the others still write (`Gathering`): a save in place commits once every record is
there, without waiting for the collective that agrees the writes succeeded to go round every
rank (8 ranks on 2 cores, each polling it with sleeps of up to 1 ms: 5-12 ms after the last
write, profiled at dp 2 x tp 2 x pp 2, 2026-11-29), and fsyncs each file left to it as its
record arrives, while the others still write. A rank whose write failed leaves no record:
the collective then tells the leader, as before.
"""

from __future__ import annotations

import json
import os
import re
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from trainer.checkpoint.files import fsync_soon
from trainer.comm.protocol import Handle

POLL_S = 0.05
"""Seconds between two looks of the leader for records when nothing woke it, and between its
looks at the agreement while it waits (`Gathering.until`). The reader wakes as a record
arrives (inotify: the rename that makes it whole), so this bounds only what inotify does not
see: a record renamed by another host on a network filesystem (NFS, Lustre) gives no event
here, and a failed save, told by the agreement. Waiting for 7 records left 50 ms apart cost
the leader 47 ms of CPU looking every 0.2 ms, 3.3 ms woken by inotify (2026-11-30)."""
_NAME = re.compile(r"rank-(\d{5})\.json")


def record_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def leave(tmp: Path, rank: int, record: dict[str, Any]) -> None:
    """Leave ``rank``'s record in the folder, whole (no fsync: the commit record, fsynced,
    holds what the leader read)."""
    hidden = tmp / f".{record_file(rank)}.tmp"
    hidden.write_bytes(json.dumps(record).encode())
    os.rename(hidden, tmp / record_file(rank))


def read(tmp: Path, rank: int) -> Any:
    """The record ``rank`` left in the folder, removed once read: a regular file, never
    through a link."""
    path = tmp / record_file(rank)
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as fh:
        record = json.loads(fh.read())
    path.unlink()
    return record


class Gathering:
    """The leader's reading of the other ranks' records, in the order they appear, in a
    thread of its own (`start`) while the leader writes its own file (the leader is often
    the last to write: the first pipeline stage ends a step last, and it writes the RNG
    file too; reading the other 7 records after its write took 3-4 ms at dp 2 x tp 2 x
    pp 2, 2026-11-29); the tensor files left to it are fsynced as their records arrive
    (`syncing`)."""

    def __init__(self, tmp: Path, size: int, leader: int = 0) -> None:
        self.tmp, self.size, self.leader = tmp, size, leader
        self.records: dict[int, Any] = {}
        self.syncing: list[Future[None]] = []
        self._stop = threading.Event()
        self._done = threading.Event()  # the reader took its last record, or failed
        self._reader: threading.Thread | None = None
        self._failed = False

    def start(self) -> None:
        """Read the records as they appear, from now on, in a thread (a daemon: a save
        abandoned before every record came never holds the process)."""
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, daemon=True,
                                            name="checkpoint-records")
            self._reader.start()

    def own(self, record: dict[str, Any]) -> None:
        """The leader's own record: taken as is, never through the folder."""
        self._took(self.leader, record)

    def until(self, handle: Handle | None) -> bool:
        """True once every record is read; False when ``handle`` (the agreement that every
        write succeeded) completed first, or a record could not be read (`rest` raises it
        again, in the commit)."""
        self.start()
        while not self._done.wait(POLL_S):
            if handle is None or handle.is_completed():
                self.stop()
        return len(self.records) == self.size and not self._failed

    def stop(self) -> None:
        """Stop reading in the thread, and wait until it is done: up to `POLL_S`, where it
        waits for a record (a failed save, or an agreement that completed before the last
        record was read)."""
        self._stop.set()
        if self._reader is not None:
            self._done.wait()

    def rest(self) -> list[Any]:
        """Every rank's record, in rank order (each rank has left its record: the ranks
        agreed that every write succeeded)."""
        self.stop()
        for rank in range(self.size):
            if rank not in self.records:
                self._take(rank)
        return [self.records[rank] for rank in range(self.size)]

    def _read(self) -> None:
        """Look in the folder, then wait for a record's rename into it (watched before the
        first look: none is missed), or `POLL_S`. A reader that fails (the user's inotify
        instances used up, a record unreadable) leaves the leader to commit after the
        agreement, reading the records itself (`rest`, which raises a record's error)."""
        arrivals = None
        try:
            from inotify_simple import INotify, flags

            arrivals = INotify()
            arrivals.add_watch(self.tmp, flags.MOVED_TO | flags.ONLYDIR)
            while self._look():
                arrivals.read(timeout=int(POLL_S * 1000))
        except Exception:  # noqa: BLE001 - read again by `rest`, which raises it
            self._failed = True
        finally:
            self._done.set()  # before the close, which waits for the kernel to drop the
            if arrivals is not None:  # watch: 13-20 ms, measured on the development VM
                arrivals.close()

    def _look(self) -> bool:
        """Take the records in the folder; True while another rank's is missing (and not
        stopped). The leader's own comes through `own`, which no rename announces: a reader
        that waited for it too slept up to `POLL_S` after the last record whenever the
        leader was the last to write (a third of `small`'s saves in place took 50 ms more,
        `bench.checkpoint_async`, 2026-11-30)."""
        for name in os.listdir(self.tmp):
            if (found := _NAME.fullmatch(name)) and int(found[1]) not in self.records:
                self._take(int(found[1]))
        others = len(self.records) - (self.leader in self.records)
        return not self._stop.is_set() and others < self.size - 1

    def _take(self, rank: int) -> None:
        self._took(rank, read(self.tmp, rank))

    def _took(self, rank: int, record: Any) -> None:
        if not record["synced"]:
            self.syncing += fsync_soon([self.tmp / name for name in record["files"]])
        self.records[rank] = record
