"""Job start-up over connected agents: SPEC to every host at once, HELLO and READY from each,
then START everywhere.

Every SPEC is sent before its agent has booted: as its stream opens (`launcher.head.early`, the
first round of a flat launch), else as soon as the streams are open. It waits in the stream
until the agent reads it, so an agent answers HELLO and READY back to back without
waiting for the head (the head answering each HELLO cost 30-60 ms on a loaded machine). Only a
SPEC too large for a pipe's buffer waits for its agent's HELLO (`EARLY_SPEC_MAX`). The HELLO
still comes first on each stream, so a different protocol version is refused before its READY
counts. Rank 0's host answers a probe in its READY (its address towards the next host, a
free port), and START carries MASTER_ADDR/MASTER_PORT to every rank: no extra round trips.
Nothing starts anywhere until every agent has answered READY (`--start together`, the
default), so a bad host starts nothing anywhere. With `--start eager` a host starts its ranks as
soon as it and rank 0's host (the rendezvous) have answered READY, as Hydra's proxies do: on a
large cluster, where hosts come up over seconds, the first hosts' ranks import their libraries
while the last ones still connect. A host that refuses the job then stops the ranks already
running elsewhere, as a failing rank would; hosts that did not answer start nothing.

A SPEC holds the ranks' contract variables and only those planned variables that decide which
program they run (`environment.program_env`: PATH, VIRTUAL_ENV...); the rest of the planned
environment, forwarded secrets such as HF_TOKEN among them, goes with START, so a host that
starts no ranks (a spare, a host of a start-up another host refused) never receives it.
"""

from __future__ import annotations

import queue
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from launcher import netroute, wire
from launcher.errors import AgentError, listed
from launcher.head.agent_link import AgentLink, Closed, Fleet, Received
from launcher.head.options import SuperviseOptions
from launcher.head.outcome import JobOutcome
from launcher.head.progress import sample_interval
from launcher.plan.environment import program_env
from launcher.plan.job import HostPlan, JobPlan, Rendezvous
from launcher.transport.stream import AgentStream

#: A SPEC up to this size is written as soon as the streams are open: it fits the buffer of any
#: pipe (64 KiB on Linux) and SSH channel window, so the write cannot block on an agent that has
#: not booted yet. A larger one (many ranks, a big environment) waits for its agent's HELLO.
EARLY_SPEC_MAX = 60 * 1024
#: How often the head looks at every link (heartbeats, silence; the supervisor's loop too):
#: at most this often, never once per event. Per event, a start-up of 1,024 hosts x 8 ranks
#: walked every link (and every rank) for each of its ~20,000 frames: seconds of the head's
#: CPU, tens of seconds on a loaded machine (`bench.sim_scale`).
CHECK_EVERY_S = 0.1
#: What each agent reports of its own start-up: its imports until HELLO, checking its SPEC,
#: starting its ranks after START.
PHASES = ("boot", "check", "spawn")


class Every:
    """Says "due" at most once per ``period`` seconds: the head's periodic walk over every
    link, shared by the start-up and the supervisor's loop."""

    def __init__(self, period: float = CHECK_EVERY_S) -> None:
        self.period = period
        self._last = -period  # the first ask is due

    def due(self, now: float) -> bool:
        if now - self._last < self.period:
            return False
        self._last = now
        return True


@dataclass(frozen=True)
class Signalled:
    """The head got a signal (SIGINT, SIGTERM, SIGHUP): an event like a frame."""

    signum: int


class Startup:
    def __init__(self, links: Sequence[AgentLink], fleet: Fleet,
                 opts: SuperviseOptions) -> None:
        """Start-up on ``links`` of ``fleet`` (in the plan's host order); the fleet's other
        links (spares, hosts of no round now) are kept alive meanwhile."""
        self.links = list(links)
        self._at = {link.index: position for position, link in enumerate(self.links)}
        self.fleet = fleet
        self.events = fleet.events
        self.opts = opts
        self._beat_at = time.monotonic()
        self._checks = Every()  # when to look at every link again
        self.deadline = float("inf")  # --launch-timeout counts from `prepare`'s SPECs
        self.hello_at = self.ready_at = 0.0  # when the last HELLO / READY arrived
        self.ready: dict[int, dict[str, Any]] = {}  # link index -> its READY
        self._unsent: dict[int, bytes] = {}  # SPECs that wait for their agent's HELLO
        self._start: bytes | None = None  # the START frame, once the rendezvous is known
        self.started: set[int] = set()  # links sent START

    @property
    def eager(self) -> bool:
        return self.opts.start == "eager"

    def prepare(self, plan: JobPlan, master: tuple[str | None, int | None]) -> Rendezvous:
        """SPEC to every host now; HELLO then READY from all; returns the rendezvous START sends.

        ``master`` holds the user's --master-addr/--master-port; a None is chosen by rank 0's
        host (its route towards the next host, 127.0.0.1 for a single host; a free port).
        """
        user_addr, user_port = master
        self.deadline = time.monotonic() + self.opts.launch_timeout
        # Those sent as their streams opened (`launcher.head.early`) go no second time.
        early = {link.index for link in self.links if link.early_spec}
        for link in self.links:
            link.early_spec = False  # a later round's start-up sends its own
        specs = {link.index: spec_frame(plan, self._at[link.index], self.opts,
                                        [x.stream for x in self.links[:2]], master)
                 for link in self.links if link.index not in early}
        self._unsent = {i: frame for i, frame in specs.items() if len(frame) > EARLY_SPEC_MAX}
        for link in self.links:
            if link.index not in self._unsent and link.index not in early:
                link.send(specs[link.index])  # a gone stream shows as Closed below
        first = self.links[0].index
        self._until((lambda: first in self.ready) if self.eager else
                    (lambda: len(self.ready) == len(self.links)), "check the job",
                    self.on_frame)
        answer = self.ready[first]
        if "probe_error" in answer:
            raise AgentError("rendezvous address not found", f"host {self.links[0].name}",
                             answer["probe_error"], "pass --master-addr and --master-port")
        return Rendezvous(user_addr or answer.get("address") or "127.0.0.1",
                          user_port or int(answer["port"]))

    def on_frame(self, link: AgentLink, frame: wire.Frame) -> None:
        """A HELLO (its protocol checked: AgentError) or a READY from ``link``."""
        if frame.kind is wire.Kind.HELLO:
            _check_protocol(link, frame.json())
            note_phase(link, "boot", link.hello)
            self.hello_at = time.monotonic()
            if (spec := self._unsent.pop(link.index, None)) is not None:
                link.send(spec)  # its agent runs and reads now: the write will end
        elif frame.kind is wire.Kind.READY and link.index not in self.ready:
            self.ready[link.index] = frame.json()
            self.ready_at = time.monotonic()
            link.watched = True  # idle after its round, it is held to the job's interval
            note_phase(link, "check", self.ready[link.index])

    def checked(self, link: AgentLink, frame: wire.Frame, stopping: bool) -> bool:
        """A HELLO or READY that came after START went out (`--start eager`): a READY starts
        that host's ranks unless the job is ``stopping``. True when the host's start-up is
        over without ranks (a READY while stopping)."""
        self.on_frame(link, frame)
        if frame.kind is not wire.Kind.READY or link.index in self.started:
            return False
        if stopping:
            return True
        self._send_start(link)
        return False

    def waiting(self) -> list[AgentLink]:
        """The links whose agents have not answered READY yet (only under `--start eager`
        once START went out); none without a walk once all have (the supervisor asks often)."""
        if len(self.ready) == len(self.links):
            return []
        return [link for link in self.links if link.index not in self.ready]

    def overdue(self, now: float) -> list[AgentLink]:
        """The links still waiting for READY past the launch timeout."""
        return self.waiting() if now > self.deadline else []

    def _send_start(self, link: AgentLink) -> None:
        assert self._start is not None  # set by `start` before any START goes out
        self.started.add(link.index)
        link.send(self._start)

    def start(self, plan: JobPlan, rendezvous: Rendezvous, outcome: JobOutcome,
              handle: Callable[[Any], None]) -> None:
        """START (carrying the rendezvous and the plan's forwarded variables) to every host
        that answered READY (every host, but under `--start eager`), then feed events to the
        supervisor until every rank has started (the supervisor hands the other hosts' READY
        back to `checked`)."""
        self._start = wire.encode_json(wire.Kind.START, {"env": rendezvous.env(),
                                                         "base": dict(plan.base_env)})
        for link in self.links:
            if link.index in self.ready:
                self._send_start(link)
        ranks = list(outcome.ranks.values())
        started = 0  # ranks[:started] have left "pending" (a rank never goes back to it)
        while True:
            while started < len(ranks) and ranks[started].state != "pending":
                started += 1
            if started == len(ranks):
                return
            if time.monotonic() > self.deadline or outcome.failures:
                return
            try:
                handle(self.events.get(timeout=0.2))
            except queue.Empty:
                pass
            if not self._checks.due(time.monotonic()):
                continue
            self._beat()
            silent = self._silent()
            if silent is not None:
                handle(Closed(silent.index, "no heartbeat while starting its ranks"))

    def _until(self, done: Callable[[], bool], doing: str,
               on_frame: Callable[[AgentLink, wire.Frame], None]) -> None:
        """Handle start-up events until ``done()``; errors, silence and Ctrl-C raise."""
        while not done():
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                booting = [link.name for link in self.links if not link.hello]
                raise AgentError(f"agents did not {doing} in time", "launch",
                                 f"no answer within the launch timeout "
                                 f"({self.opts.launch_timeout}s)" + (
                                     f"; not started yet: {listed(booting, 8)}" if booting
                                     else ""),
                                 "check the hosts with `dtrain check`, or raise "
                                 "--launch-timeout on a loaded cluster")
            try:
                event = self.events.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                event = None
            checks = self._checks.due(time.monotonic())
            if checks:
                self._beat()
            if isinstance(event, Received | Closed) and event.host not in self._at:
                self.fleet.idle_event(event)
            elif isinstance(event, Closed):
                _agent_failed(self.links[self._at[event.host]], f"could not {doing}",
                              event.reason)
            elif isinstance(event, Signalled):
                raise KeyboardInterrupt
            elif isinstance(event, Received):
                link = self.links[self._at[event.host]]
                link.last_heard = time.monotonic()
                if event.frame.kind is wire.Kind.ERROR:
                    body = event.frame.json()
                    raise AgentError(str(body.get("what")), f"host {link.name}",
                                     str(body.get("why")), str(body.get("fix", "")))
                on_frame(link, event.frame)
            silent = self._silent() if checks else None
            if silent is not None:
                raise AgentError(f"agent did not {doing}", f"host {silent.name}",
                                 "no heartbeat (host down or network cut?)",
                                 "nothing was started; check the host")

    def _beat(self) -> None:
        """Heartbeats while starting to agents that said HELLO (a later round's start-up may
        be long: agents that already ran a round judge the head's silence by the job's
        interval); nothing is written ahead of a SPEC that waits for its agent's HELLO."""
        now = time.monotonic()
        beat = now - self._beat_at >= self.opts.heartbeat
        if beat:
            self._beat_at = now
            self.fleet.heartbeat([link for link in self.links if link.hello])
        self.fleet.tend_idle(self._at, now, beat=beat,
                             limit=self.opts.heartbeat * self.opts.misses)

    def _silent(self) -> AgentLink | None:
        # Agents send heartbeats at the default interval until the SPEC sets the job's.
        first = wire.Watch()
        limit = max(self.opts.heartbeat * self.opts.misses, first.heartbeat * first.misses)
        now = time.monotonic()
        for link in self.links:
            if link.held:
                continue  # its reader waits for our full output queue: not the agent's silence
            if not link.hello:
                # Still booting (its shell, Python, its imports: 15 s and more when 64 agents
                # and their ranks start on two cores): it cannot beat before HELLO. The launch
                # timeout bounds it, and the transport's keepalives a host that went away.
                continue
            if now - link.last_heard > limit:
                return link
        return None


def spec_frame(plan: JobPlan, index: int, opts: SuperviseOptions,
               first: Sequence[AgentStream], master: tuple[str | None, int | None]) -> bytes:
    """Host ``index``'s SPEC frame for the start-up of ``plan``; ``first`` holds the streams
    of hosts 0 and 1 (host 0's probe asks its route towards host 1: `launcher.head.early`
    sends each SPEC as soon as these are open)."""
    probe = None
    if index == 0:
        user_addr, user_port = master
        probe = wire.Probe(None if user_addr or len(first) == 1 else _next_host(*first[:2]),
                           free_port=user_port is None)
    spec = spec_of(plan, plan.hosts[index], opts, probe)
    return wire.encode_json(wire.Kind.SPEC, spec.to_json())


def early_spec_for(plan: JobPlan, opts: SuperviseOptions, master: tuple[str | None, int | None]
                   ) -> Callable[[int, Sequence[AgentStream]], bytes | None]:
    """`launcher.head.early`'s SPEC of host i as its stream opens: the frame the start-up
    would send (`spec_frame`), None when it is too large to go before its agent reads."""

    def spec_for(index: int, first: Sequence[AgentStream]) -> bytes | None:
        frame = spec_frame(plan, index, opts, first, master)
        return frame if len(frame) <= EARLY_SPEC_MAX else None

    return spec_for


def _next_host(first: AgentStream, second: AgentStream) -> str:
    """An address of host 1 as seen from host 0, for rank 0's host to route towards."""
    if second.is_local:
        # Host 1 is the head itself: its address on the route towards host 0.
        return netroute.route_source(_address_of(first))
    return _address_of(second)


def spec_of(plan: JobPlan, host_plan: HostPlan | None, opts: SuperviseOptions,
            probe: wire.Probe | None = None) -> wire.AgentSpec:
    """What one host runs, as its SPEC frame carries it; with no ``host_plan`` no ranks (a
    spare's check of the job: its working directory and program). Never the forwarded
    variables beyond those that find the program: START carries them (see the module)."""
    return wire.AgentSpec(
        job_id=plan.job_id, argv=plan.argv, cwd=plan.cwd,
        ranks=tuple(wire.RankStart(r.rank, dict(r.env)) for r in host_plan.ranks)
        if host_plan is not None else (),
        watch=opts.watch, rounds=opts.rounds,
        pmi=wire.PmiSpec(opts.pmi if host_plan is not None else "off", plan.kvsname,
                         plan.world_size, plan.process_mapping, opts.pmi_stall),
        progress_interval=sample_interval(opts, len(plan.hosts))
        if host_plan is not None else None,
        probe=probe, check_env=program_env(plan.base_env))


def _check_protocol(link: AgentLink, hello: dict[str, Any]) -> None:
    link.hello = hello
    if hello.get("protocol") != wire.PROTOCOL_VERSION:
        raise AgentError("agent speaks another protocol", f"host {link.name}",
                         f"head {wire.PROTOCOL_VERSION}, agent {hello.get('protocol')} "
                         f"(dtrain {hello.get('dtrain')})",
                         "install the same dtrain version on every host")


def note_phase(link: AgentLink, phase: str, body: dict[str, Any]) -> None:
    """An agent's ``<phase>_s`` report; agents of older versions send none."""
    if isinstance(seconds := body.get(f"{phase}_s"), int | float):
        link.phases[phase] = max(float(seconds), link.phases.get(phase, 0.0))


def slowest_phases(links: Sequence[AgentLink]) -> str:
    """Each agent phase's slowest host, e.g. ``boot 0.071s (node2), check 0.004s (node1)``."""
    parts = []
    for phase in PHASES:
        timed = [(link.phases[phase], link.name) for link in links if phase in link.phases]
        if timed:
            seconds, name = max(timed)
            parts.append(f"{phase} {seconds:.3f}s ({name})")
    return ", ".join(parts)


def _address_of(stream: AgentStream) -> str:
    """The address the head reached this host at (the SSH peer), else its name resolved."""
    if stream.is_local:
        return "127.0.0.1"
    if stream.connection is not None:
        return stream.connection.peer_address()
    return str(socket.getaddrinfo(stream.host, None, type=socket.SOCK_STREAM)[0][4][0])


def _agent_failed(link: AgentLink, what: str, why: str) -> None:
    if (failure := link.stream.transport_error()) is not None:
        raise failure
    stderr = link.stderr_text().strip()
    if stderr:
        why += f"; agent stderr: {stderr.splitlines()[-1]}"
    raise AgentError(f"agent {what}", f"host {link.name}", why,
                     "check that dtrain is installed in the same Python on that host, not "
                     "only on PYTHONPATH, which its agent ignores (`dtrain check`)")

