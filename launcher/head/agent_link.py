"""The head's end of one agent stream: what is read off it is routed, and a sender.

Each read's frames are handled on the thread that read them: OUTPUT frames go to the output
writer (`launcher.output.writer`), blocking while its queue is full, and every other frame is
queued for the supervisor, in stream order, so a rank's EXIT is seen only after all of its
output was queued. Liveness is judged on what arrives: each read stamps ``last_heard``, and
``held`` is set while the reading is blocked on our own full output queue (then the agent is
not silent: we stopped listening).

Who reads a stream is chosen once, when its link is built, by what the stream offers:

* one that can be polled (``reader_fd``: pipes, SSH channels, sockets) is read by the fleet's
  one `launcher.transport.pump.ReadPump` thread with every other such stream. A thread per stream
  made the flat head's CPU grow faster than its hosts (`bench.sim_scale`). A held-up read
  holds up every stream of the pump, which their ``held`` says;
* one that delivers its bytes itself (``listen``: a host behind a relay, whose bytes a
  `launcher.tree.head.RelayLine` thread already reads off the relay's stream) runs the same
  handling on the delivering thread; held up there, it holds up its relay's whole line
  (`RelayedStream.held`);
* any other (a stream with only a blocking ``read``) gets a reader thread of its own.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from launcher import wire
from launcher.transport.pump import Hold, ReadPump
from launcher.transport.stream import AgentStream


@dataclass(frozen=True)
class Received:
    host: int
    frame: wire.Frame


@dataclass(frozen=True)
class Closed:
    host: int
    reason: str


class EventQueue(queue.Queue[Any]):
    """The supervisor's events: a queue that takes a read's frames at once (`put_all`)."""

    def put_all(self, items: list[Any]) -> None:
        with self.not_full:  # unbounded: never waits for room
            self.queue.extend(items)
            self.unfinished_tasks += len(items)
            self.not_empty.notify()


def _put_all(events: queue.Queue[Any], batch: list[Any]) -> None:
    """Queue ``batch`` (emptied) in one step where ``events`` can (`EventQueue`)."""
    if not batch:
        return
    if isinstance(events, EventQueue):
        events.put_all(batch)
    else:
        for item in batch:
            events.put(item)
    batch.clear()


class AgentLink:
    """One host's agent as the supervisor sees it."""

    def __init__(self, index: int, stream: AgentStream, events: queue.Queue[Any],
                 on_output: Callable[[wire.Output], None], pump: ReadPump | None = None) -> None:
        """``pump`` reads the stream when it can be polled (see the module)."""
        self.index = index
        self.stream = stream
        self.name = stream.host
        self.last_heard = time.monotonic()
        self._hold = Hold()  # set while the reading waits for room in our output queue
        self.alive = True
        # Its agent answered a SPEC (READY): it beats at the job's interval from then on, so the
        # job's silence limit applies; before, it boots and beats at the default interval.
        self.watched = False
        self.hello: dict[str, Any] = {}
        # Its SPEC went as its stream opened (`launcher.head.early`): the start-up skips it.
        self.early_spec = False
        # The agent's own start-up phases in seconds (`dtrain launch --timings`): boot (its
        # imports, from HELLO), check (the SPEC, from READY), spawn (its ranks, from STARTED).
        self.phases: dict[str, float] = {}
        self._events = events
        self._on_output = on_output
        self._lock = threading.Lock()
        self._decoder = wire.Decoder()
        self._ended = False
        listen = getattr(stream, "listen", None)
        self._delivers = listen is not None  # looked up once: `held` is read per link often
        if listen is not None:  # it delivers: no thread of our own (see the module)
            listen(self._delivered, self._end)
        elif pump is not None and hasattr(stream, "reader_fd"):
            self._hold = pump.hold  # the pump's one thread reads every stream
            pump.add(stream, self._received, self._stream_ended)  # type: ignore[arg-type]
        else:
            threading.Thread(target=self._read_loop, name=f"agent-{index}", daemon=True).start()

    @property
    def held(self) -> bool:
        """Our own full output queue holds up its reading (the agent is not silent)."""
        return self._hold.held or (self._delivers and bool(getattr(self.stream, "held", False)))

    def send(self, data: bytes) -> bool:
        """Send one frame; False when the stream is gone (the caller treats the host as lost)."""
        if not self.alive:
            return False
        with self._lock:
            try:
                self.stream.write(data)
                return True
            except (OSError, EOFError, ValueError):
                return False

    def send_json(self, kind: wire.Kind, obj: dict[str, Any] | None = None) -> bool:
        return self.send(wire.encode_json(kind, obj))

    def silence_limit(self, limit: float) -> float:
        """How long this agent may stay silent: the job's ``limit`` once it runs by the job's
        heartbeats (``watched``), else at least the default's (it boots, then beats at the
        default interval until it reads its SPEC): a spare is held to what a host starting
        ranks is held to."""
        if self.watched:
            return limit
        return max(limit, wire.Watch().limit)

    def stderr_text(self) -> str:
        return self.stream.stderr_text()

    def close(self) -> None:
        self.alive = False
        try:
            self.stream.close()
        except OSError:
            pass

    def _read_loop(self) -> None:
        error: BaseException | None = None
        try:
            while data := self.stream.read(65536):
                self._received(data)
        except (OSError, EOFError, ValueError) as exc:
            error = exc
        self._stream_ended(error)

    def _delivered(self, data: bytes) -> None:
        """Bytes a listened stream delivers (on its thread); a broken frame ends this host's
        stream only, never the thread that delivers every host of a relay."""
        if self._ended:
            return
        try:
            self._received(data)
        except (OSError, EOFError, ValueError) as exc:
            self._end(f"the agent's stream broke: {exc}")

    def _stream_ended(self, error: BaseException | None) -> None:
        """Its reader (a thread of its own, or the pump) says the stream ended: closed (None)
        or broken by ``error``."""
        self._end("the agent's stream closed" if error is None
                  else f"the agent's stream broke: {error}")

    def _received(self, data: bytes) -> None:
        """The frames of one read: output to the writer, the rest queued together (one
        wake-up of the supervisor per read, not per frame), in stream order."""
        self.last_heard = time.monotonic()
        batch: list[Received] = []
        for frame in self._decoder.feed(data):
            if frame.kind is wire.Kind.OUTPUT:
                _put_all(self._events, batch)
                self._output(wire.decode_output(frame))
            else:
                batch.append(Received(self.index, frame))
        _put_all(self._events, batch)

    def _end(self, reason: str = "the agent's stream closed") -> None:
        if not self._ended:
            self._ended = True
            self._events.put(Closed(self.index, reason))

    def _output(self, out: wire.Output) -> None:
        self._hold.held = True
        try:
            self._on_output(out)  # blocks while the output queue is full
        finally:
            self.last_heard = time.monotonic()  # before `held` drops: never seen stale
            self._hold.held = False


class Fleet:
    """Every agent link of one job, across its rounds (`launcher.restart`): one event queue,
    and the output of every link goes to the writer of the round that runs (``output``).

    Links are numbered in the order they were added and keep their number for the job: a
    round runs on some of them (`launcher.head.supervisor`); the others are idle (spares, and
    between rounds every healthy host). Their events reach `idle_event`: a link that closes
    is dead, a spare's READY says it checked the job, its ERROR what is wrong with it. A link
    that runs no round and is lost (silent, its stream closed) is said once, to ``on_lost``.
    """

    def __init__(self) -> None:
        self.events: queue.Queue[Any] = EventQueue()
        self.links: list[AgentLink] = []
        self.output: Callable[[wire.Output], None] = lambda out: None
        self.on_lost: Callable[[AgentLink, str], None] = lambda link, why: None
        self.checked: dict[int, str] = {}  # link index -> "" (READY) or what its agent refused
        self.replies: dict[int, dict[str, Any]] = {}  # link index -> its last REPLY
        self.dropped: set[int] = set()  # links given up (lost hosts): never waited for
        self.pump = ReadPump()  # reads every link's stream that can be polled

    def add(self, stream: AgentStream) -> AgentLink:
        link = AgentLink(len(self.links), stream, self.events, lambda out: self.output(out),
                         self.pump)
        self.links.append(link)
        return link

    def idle_event(self, event: Received | Closed) -> None:
        """An event of a link that runs no round now."""
        link = self.links[event.host]
        if isinstance(event, Closed):
            self._lose(link, event.reason)
            return
        kind = event.frame.kind
        if kind is wire.Kind.READY:
            self.checked[link.index] = ""
            link.watched = True
        elif kind is wire.Kind.ERROR:
            body = event.frame.json()
            self.checked[link.index] = f"{body.get('what')}: {body.get('why')}"
        elif kind is wire.Kind.REPLY:
            self.replies[link.index] = event.frame.json()
        elif kind is wire.Kind.HELLO:
            link.hello = event.frame.json()

    def drop(self, link: AgentLink) -> None:
        """The link is gone for good: nothing more will come from it."""
        self.dropped.add(link.index)
        link.close()
        link.stream.abort()

    def tend_idle(self, busy: Mapping[int, object], now: float, *, beat: bool,
                  limit: float) -> None:
        """The links not in ``busy`` (a round's): a heartbeat if ``beat``, and a silent one
        (more than ``limit`` seconds) is dropped: a spare gone is no spare."""
        idle = [link for link in self.links if link.alive and link.index not in busy]
        for link in self.heartbeat(idle) if beat else []:
            self._lose(link, "the stream to its agent broke")
        for link in self.silent(idle, limit, now):
            self._lose(link, f"no heartbeat for {now - link.last_heard:.1f}s")

    def _lose(self, link: AgentLink, why: str) -> None:
        """An idle link is gone: dropped, and said once (not when we closed it ourselves)."""
        said = link.alive
        self.drop(link)
        if said:
            self.on_lost(link, why)

    def release(self, link: AgentLink) -> None:
        """BYE and close now, without waiting: the head keeps its heartbeats going (a host
        leaving between rounds); its transport is waited for with the rest in `dismiss`."""
        link.send_json(wire.Kind.BYE)
        link.close()

    def heartbeat(self, links: list[AgentLink]) -> list[AgentLink]:
        """A heartbeat to each live link of ``links``; returns those whose stream broke."""
        return [link for link in links
                if link.alive and not link.send(wire.encode(wire.Kind.HEARTBEAT))]

    def silent(self, links: list[AgentLink], limit: float, now: float) -> list[AgentLink]:
        """The live links of ``links`` silent for longer than ``limit`` seconds, or the
        default's while their agent has not answered a SPEC (`AgentLink.silence_limit`); a
        held link is not silent."""
        return [link for link in links if link.alive and not link.held
                and now - link.last_heard > link.silence_limit(limit)]

    def dismiss(self, links: list[AgentLink], wait: float = 5.0) -> None:
        """BYE and close; agents still holding ranks SIGKILL them on BYE/EOF. Waits up to
        ``wait`` seconds for each transport to end, then kills what is left of it."""
        for link in links:
            link.send_json(wire.Kind.BYE)
            link.close()
        deadline = time.monotonic() + wait
        for link in links:
            if link.index in self.dropped:
                continue  # nothing to wait for on a dead connection
            if link.stream.wait(timeout=max(0.0, deadline - time.monotonic())) is None:
                link.stream.kill()
