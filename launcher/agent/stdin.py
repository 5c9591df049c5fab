"""Rank 0's stdin on its agent: the bytes the head forwards, written by a thread of its own.

The main loop hands each STDIN frame to `RankStdin.put` and never blocks: a thread writes into
the rank's stdin pipe (blocking while the rank does not read) and answers each chunk with
STDIN_ACK, the credit that lets the head read more of its stdin (launcher.head.stdin). An
empty chunk is EOF: the pipe is closed. If the rank closed its stdin or exited, later chunks
are dropped but still acknowledged, so the head never waits for a reader that is gone.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from typing import IO


class RankStdin:
    def __init__(self, pipe: IO[bytes] | None, ack: Callable[[int], None]) -> None:
        self._pipe = pipe
        self._ack = ack
        self._chunks: queue.SimpleQueue[bytes] = queue.SimpleQueue()  # bounded by the credit
        threading.Thread(target=self._run, name="rank0-stdin", daemon=True).start()

    def put(self, data: bytes) -> None:
        self._chunks.put(data)

    def _run(self) -> None:
        while True:
            data = self._chunks.get()
            if not data:
                self._close()
                continue  # nothing more should come; keep acknowledging if it does
            if self._pipe is not None:
                try:
                    self._pipe.write(data)
                    self._pipe.flush()
                except (OSError, ValueError):
                    self._close()  # the rank closed its stdin or exited: drop the rest
            self._ack(len(data))

    def _close(self) -> None:
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass
