"""The head's end of an agent stream (`launcher.head.agent_link`): what one read brings is
handled in stream order, rank output before the frames after it, on an in-memory stream."""

from __future__ import annotations

import queue
import threading

from launcher import wire
from launcher.head.agent_link import Closed, EventQueue, Fleet, Received

K = wire.Kind


class OneRead:
    """A stream that gives its bytes in one read, then its end."""

    is_local = False
    connection = None
    host = "node1"

    def __init__(self, data: bytes) -> None:
        self.reads: queue.Queue[bytes] = queue.Queue()
        self.reads.put(data)
        self.reads.put(b"")

    def read(self, max_bytes: int = 65536) -> bytes:
        return self.reads.get()


def test_one_reads_frames_reach_the_supervisor_in_order_with_output_handed_over_between():
    order: list[object] = []
    fleet = Fleet()
    seen = threading.Event()

    def output(out: wire.Output) -> None:
        order.append(("output", out.rank, out.data, fleet.events.qsize()))
        seen.set()

    fleet.output = output
    data = (wire.encode_json(K.STARTED, {"rank": 0}) + wire.encode_json(K.STARTED, {"rank": 1})
            + wire.encode_output(0, 1, b"hi\n") + wire.encode_json(K.EXIT, {"rank": 0})
            + wire.encode(K.DONE))
    fleet.add(OneRead(data))  # type: ignore[arg-type]
    assert seen.wait(5)  # nothing is taken off the queue before: it holds what came before
    assert order == [("output", 0, b"hi\n", 2)]  # both STARTED queued, the EXIT not yet
    events = [fleet.events.get(timeout=5) for _ in range(5)]
    kinds = [e.frame.kind if isinstance(e, Received) else "closed" for e in events]
    assert kinds == [K.STARTED, K.STARTED, K.EXIT, K.DONE, "closed"]
    assert isinstance(events[-1], Closed)


def test_the_event_queue_takes_a_batch_in_one_step_and_gives_it_back_one_by_one():
    events = EventQueue()
    events.put_all([1, 2, 3])
    events.put(4)
    assert [events.get_nowait() for _ in range(4)] == [1, 2, 3, 4] and events.empty()
