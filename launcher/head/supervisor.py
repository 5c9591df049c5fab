"""Runs one job, or one round of it, over connected agents: start everywhere or nowhere, then
supervise to the end.

Start-up is two-phase: every agent checks the SPEC (working directory, program) and answers
READY; only when all hosts are READY does any rank start, so a bad host starts nothing anywhere
(under `--start eager` a host starts once it and rank 0's host are READY: `launcher.head.startup`).
Then the supervisor serves PMI from the head's key-value space, and stops the whole job on the
first failure, on Ctrl-C/SIGTERM, on --timeout, or when a host falls silent.

Under `--max-restarts` (`launcher.restart.rounds`) a job is rounds over one `Fleet` of agent
links: a round runs on some links (its hosts, in node order), keeps the others alive, and at
its end leaves the agents connected for the next (``keep_agents``).

The supervisor loop does no output I/O: the ranks' output goes from each link's reader thread
to the output writer thread (`launcher.output.writer`), so a slow reader of our stdout slows the
ranks down (back-pressure) but never delays a heartbeat, a host-loss check or a KILL.
"""

from __future__ import annotations

import queue
import signal
import time
from collections.abc import Sequence
from typing import Any

from launcher import wire
from launcher.errorfile import RootCause
from launcher.errors import AgentError
from launcher.head.agent_link import AgentLink, Closed, Fleet, Received
from launcher.head.options import SuperviseOptions
from launcher.head.outcome import Failure, JobOutcome, RankOutcome
from launcher.head.pmi_notes import PmiRelay
from launcher.head.progress import HANG_CODE, ProgressMonitor
from launcher.head.startup import CHECK_EVERY_S, Every, Signalled, Startup, note_phase
from launcher.head.stdin import StdinForwarder
from launcher.output.sink import OutputSink
from launcher.output.writer import OutputWriter
from launcher.plan.job import JobPlan
from launcher.pmi.actions import push_and_release
from launcher.transport.stream import AgentStream

LOST_CODE = 255
KILLED_DRAIN_S = 2.0  # after a second Ctrl-C, how long output still queued may take


class Supervisor:
    def __init__(self, fleet: Fleet, links: Sequence[AgentLink], plan: JobPlan,
                 sink: OutputSink, opts: SuperviseOptions, *, keep_agents: bool = False,
                 stdin: bool = True) -> None:
        """A round on ``links`` of ``fleet`` (in the plan's host order). ``keep_agents``: leave
        them connected at the end (the caller dismisses them); ``stdin``: forward the head's
        stdin to rank 0 (else rank 0 reads EOF)."""
        self.fleet = fleet
        self.events = fleet.events
        self.writer = OutputWriter()
        fleet.output = lambda out: self.writer.put(out.rank, out.stream, out.data)
        self.links = list(links)
        self._at = {link.index: position for position, link in enumerate(self.links)}
        self.keep_agents = keep_agents
        self.stdin = StdinForwarder(self.links[0]) if stdin else None  # rank 0: the first host
        self.opts = opts
        self.plan = plan
        self._sink = sink
        self.outcome = JobOutcome({r.rank: RankOutcome(r.rank, hp.entry.name)
                                   for hp in plan.hosts for r in hp.ranks})
        self.pmi: PmiRelay | None = None  # made in `run`, while the agents boot
        self.startup = Startup(self.links, fleet, opts)
        # A fetch's answer, every card, as one frame: encoded once per epoch of the key-value
        # space (its store changes only when a fence completes), the same bytes to every host.
        self._cards: tuple[int, bytes] | None = None
        self.stopping = False
        self.killed_hard = False
        self.done_hosts: set[int] = set()
        self.lost_hosts: set[int] = set()
        self._give_up_at = float("inf")
        self.progress = ProgressMonitor(opts, self._probe, self._say, sink.log_dir,
                                        time.monotonic())
        self.timings: dict[str, float] = {}
        self._draining = False
        self.failed_at: float | None = None    # when the first failure happened (best guess)
        self.detected_at: float | None = None  # when the head noticed it
        self.hung: tuple[int, ...] = ()        # the ranks a hang diagnosis stopped the job for

    @classmethod
    def over(cls, streams: Sequence[AgentStream], plan: JobPlan, sink: OutputSink,
             opts: SuperviseOptions) -> Supervisor:
        """A one-round job on ``streams``, a fleet of its own (dismissed at the end)."""
        fleet = Fleet()
        return cls(fleet, [fleet.add(s) for s in streams], plan, sink, opts)

    # -- signals (installed by the CLI; run in the main thread) -----------------------------
    def on_signal(self, signum: int, _frame: Any = None) -> None:
        if self._draining:
            self.writer.abandon()  # the job is over; the user does not want to wait for output
            return
        self.events.put(Signalled(signum))

    # -- the whole job ------------------------------------------------------------------------
    def run(self, master: tuple[str | None, int | None] = (None, None),
            started: float | None = None) -> JobOutcome:
        """The whole job (round): start-up (``master`` holds --master-addr/--master-port, None
        where rank 0's host chooses), supervision to the end, the output drained. --timeout
        counts from ``started`` (the job's start; default now)."""
        t0 = time.monotonic() if started is None else started
        self.pmi = PmiRelay(hosts=len(self.links), kvsname=self.plan.kvsname, mode=self.opts.pmi,
                            stall_after=self.opts.pmi_stall, say=self._say)
        startup = self.startup
        try:
            rendezvous = startup.prepare(self.plan, master)
        except BaseException:
            if not self.keep_agents:
                self.fleet.dismiss(self.fleet.links)
            raise
        self.writer.start(self._sink)
        startup.start(self.plan, rendezvous, self.outcome, self._handle)
        if self.stdin is not None:
            self.stdin.start()
        else:
            self.links[0].send(wire.encode(wire.Kind.STDIN))  # EOF for rank 0
        self.timings.update(hello=startup.hello_at, ready=startup.ready_at,
                            running=time.monotonic())
        self._loop(t0)
        if self.stdin is not None:
            self.stdin.stop()
        self.timings["exit"] = time.monotonic()
        self._draining = True
        self.writer.close(KILLED_DRAIN_S if self.killed_hard else None)
        return self.outcome

    def _loop(self, t0: float) -> None:
        deadline = t0 + self.opts.timeout if self.opts.timeout else None
        last_beat = time.monotonic()
        checks = Every()
        while len(self.done_hosts) < len(self.links):
            now = time.monotonic()
            # The periodic checks walk every link: at most every CHECK_EVERY_S, not once per
            # event (a fence of 1,000 hosts is 1,000 events in a burst).
            if checks.due(now):
                beat = now - last_beat >= self.opts.heartbeat
                if beat:
                    for link in self.fleet.heartbeat(self._booted()):
                        self._host_lost(link, "the stream to its agent broke")
                    last_beat = now
                self.fleet.tend_idle(self._at, now, beat=beat,
                                     limit=self.opts.heartbeat * self.opts.misses)
                self._check_silence(now)
                for link in self.startup.overdue(now):  # `--start eager`: never answered READY
                    self._host_lost(link, "its agent did not check the job within the launch "
                                          f"timeout ({self.opts.launch_timeout}s)")
                self._check_pmi_stall(now)
                self._check_progress(now)
                if deadline is not None and now >= deadline and not self.stopping:
                    self.outcome.timed_out = True
                    self._stop(signal.SIGTERM, self.opts.grace)
                if self.stopping and now >= self._give_up_at and not self._output_holds():
                    # Hosts still checking (a round may follow) started nothing: they answer,
                    # or `overdue` ends them; the others' ranks' fate is unknown: lost.
                    waiting = self.startup.waiting()
                    for link in self.links:
                        if link not in waiting:
                            self._host_lost(link, "did not report its ranks stopped in time")
                    if len(self.done_hosts) == len(self.links):
                        break
            try:
                event = self.events.get(timeout=CHECK_EVERY_S)
            except queue.Empty:
                continue
            self._handle(event)
        if not self.keep_agents:
            self.fleet.dismiss(self.fleet.links)

    def _running(self) -> list[AgentLink]:
        return [link for link in self.links if link.index not in self.done_hosts]

    def _booted(self) -> list[AgentLink]:
        """The running links whose agents said HELLO. One still booting (`--start eager`)
        cannot beat, so it is not held to the silence limit (the launch timeout bounds it),
        and no heartbeat goes ahead of a SPEC that waits for its HELLO."""
        return [link for link in self._running() if link.hello]

    def _output_holds(self) -> bool:
        """Stopping waits for ranks whose output we are still writing (not after a 2nd Ctrl-C)."""
        return not self.killed_hard and any(link.held for link in self._running())

    def _check_silence(self, now: float) -> None:
        # A held link: we stopped reading it (our stdout is slow), not the agent's silence.
        for link in self.fleet.silent(self._booted(), self.opts.heartbeat * self.opts.misses,
                                      now):
            self._host_lost(link, f"no heartbeat for {now - link.last_heard:.1f}s "
                                  "(host down or network cut?)", at=link.last_heard)

    def _check_pmi_stall(self, now: float) -> None:
        """A barrier some hosts entered long ago: ask the others which ranks hold it up."""
        assert self.pmi is not None  # made before the loop
        for host in self.pmi.stall_queries(now, [link.name for link in self.links]):
            self.links[host].send_json(wire.Kind.PMI, {"op": "stall_query"})

    def _check_progress(self, now: float) -> None:
        """Hang diagnosis and the live view; --hang-action abort stops the job."""
        found = self.progress.tick(now, {link.index for link in self._running()})
        if found is not None and self.opts.hang_action == "abort" and not self.stopping:
            self.hung = tuple(r for r in found.culprit_ranks if r in self.outcome.ranks)
            where = ", ".join(f"rank {r}@{self.outcome.ranks[r].host}" for r in self.hung) \
                or "job"
            stalled = self.progress.clock.stalled_for(now) if self.progress.clock else 0.0
            self._fail(Failure(HANG_CODE, where, f"hung ({found.headline}); stopped by "
                               "--hang-action abort"), at=now - stalled)

    def _probe(self, body: dict[str, Any]) -> None:
        for link in self._running():
            link.send_json(wire.Kind.PROBE, body)

    def _say(self, text: str) -> None:
        self.writer.notice(text)  # in order with the ranks' stderr; never blocks the loop

    # -- events -----------------------------------------------------------------------------------
    def _handle(self, event: Any) -> None:
        if isinstance(event, Received | Closed) and event.host not in self._at:
            self.fleet.idle_event(event)  # a spare, or a host of no round now
        elif isinstance(event, Received):
            self._on_frame(self.links[self._at[event.host]], event.frame)
        elif isinstance(event, Closed) and event.host in self.done_hosts:
            self.fleet.drop(self.links[self._at[event.host]])  # gone before the next round
        elif isinstance(event, Closed):
            self._host_lost(self.links[self._at[event.host]], event.reason)
        elif isinstance(event, Signalled):
            self._on_signal(event.signum)

    def _on_frame(self, link: AgentLink, frame: wire.Frame) -> None:
        kind = frame.kind
        if kind is wire.Kind.STARTED:
            body = frame.json()
            note_phase(link, "spawn", body)
            r = self.outcome.ranks[int(body["rank"])]
            r.state, r.pid = "running", int(body["pid"])
        elif kind is wire.Kind.EXIT:
            self._on_exit(frame.json())
        elif kind is wire.Kind.STDIN_ACK and self.stdin is not None:
            self.stdin.acked(int(frame.json().get("bytes", 0)))
        elif kind is wire.Kind.PMI:
            self._on_pmi(link, frame.json())
        elif kind is wire.Kind.PROGRESS:
            self.progress.on_progress(link.index, frame.json())
        elif kind is wire.Kind.DONE:
            self.done_hosts.add(link.index)
            if getattr(link.stream, "relays", False):  # its subtree's streams run through it
                if not self.keep_agents:
                    link.send_json(wire.Kind.BYE)
            elif not self.keep_agents or not self.opts.rounds:
                # No round follows: it leaves now, while the others finish (the head waited
                # for every host's DONE before the first BYE: 1,024 agents then left at once
                # at the end, `bench.sim_scale`'s exit tail); its end is waited for with the
                # rest (`Fleet.dismiss`).
                self.fleet.release(link)
        elif kind in (wire.Kind.HELLO, wire.Kind.READY):
            self._checked(link, frame)
        elif kind is wire.Kind.ERROR:
            body = frame.json()
            if link in self.startup.waiting():  # it refused the job (`--start eager`)
                self.done_hosts.add(link.index)
            fix = f". {body['fix']}" if body.get("fix") else ""
            self._fail(Failure(LOST_CODE, f"host {link.name}",
                               f"{body.get('what')}: {body.get('why')}{fix}"))

    def _checked(self, link: AgentLink, frame: wire.Frame) -> None:
        """`--start eager`: a host's HELLO or READY after the first hosts' ranks started."""
        try:
            over = self.startup.checked(link, frame, self.stopping)
        except AgentError as exc:  # it speaks another protocol: it starts nothing
            self._fail(Failure(LOST_CODE, exc.where, f"{exc.what}: {exc.why}. {exc.fix}"))
            over = True
        if over:
            self.done_hosts.add(link.index)

    def _on_exit(self, body: dict[str, Any]) -> None:
        rank = int(body["rank"])
        self.writer.flush_rank(rank)
        sent = tuple((int(sig), float(after)) for sig, after in body.get("sent") or ())
        failure = self.outcome.rank_exited(rank, int(body["code"]), body.get("signal"),
                                           self.stopping, RootCause.from_json(body.get("error")),
                                           sent)
        if failure is not None:
            self._fail(failure)

    def _on_pmi(self, link: AgentLink, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "abort":
            if self.outcome.abort is None:
                self.outcome.abort = Failure(int(msg.get("code", 1)),
                                             f"rank {msg.get('rank')}@{link.name}",
                                             f"MPI_Abort: {msg.get('message') or 'no message'}")
                if self.detected_at is None:
                    self.failed_at = self.detected_at = time.monotonic()
                self._stop(signal.SIGTERM, self.opts.grace)
        elif op == "rank_failed":
            if not self.stopping:  # else a consequence of our own stop, not a new failure
                rank = int(msg["rank"])
                self._fail(Failure(1, f"rank {rank}@{link.name}", str(msg.get("reason")), rank,
                                   inferred=True))
        elif self.pmi is not None:
            # A relay's fence stands for its subtree's hosts, named by their tree index.
            if "hosts" in msg:
                tree = {getattr(x.stream, "tree_index", x.index): p
                        for p, x in enumerate(self.links)}
                msg = {**msg, "hosts": [tree[h] for h in msg["hosts"] if h in tree]}
            # A fence's answer, the same keys for every host: (id of its cards, what) -> bytes
            fence: dict[tuple[int, str], bytes] = {}
            released: list[tuple[int, bytes]] = []
            for host, reply in self.pmi.handle(self._at[link.index], link.name, msg):
                if "hosts" in reply:  # the cards encoded once, each relay's hosts its own
                    reply["hosts"] = [getattr(self.links[p].stream, "tree_index", p)
                                      for p in reply["hosts"]]
                    if (cards := (id(reply["kv"]), "value")) not in fence:
                        fence[cards] = wire.encode_value(reply["kv"])
                    data = wire.encode_json_shared(wire.Kind.PMI, reply, "kv", fence[cards])
                elif reply.get("op") == "barrier_out" and reply.get("kv"):
                    if (cards := (id(reply["kv"]), "push")) not in fence:  # encoded once
                        push, release = push_and_release(reply)
                        fence[cards] = wire.encode_json(wire.Kind.PMI, push)
                        fence[cards[0], "out"] = wire.encode_json(wire.Kind.PMI, release)
                    data = fence[cards]
                    released.append((host, fence[cards[0], "out"]))
                elif reply.get("op") == "cards":  # the same bytes to every host's fetch
                    epoch = self.pmi.kvs.epoch
                    if self._cards is None or self._cards[0] != epoch:
                        self._cards = epoch, wire.encode_json(wire.Kind.PMI, reply)
                    data = self._cards[1]
                elif "kv" in reply:  # encoded once (it grows as hosts x ranks), sent N times
                    if (cards := (id(reply["kv"]), "frame")) not in fence:
                        fence[cards] = wire.encode_json(wire.Kind.PMI, reply)
                    data = fence[cards]
                else:
                    data = wire.encode_json(wire.Kind.PMI, reply)
                self.links[host].send(data)
            for host, data in released:
                self.links[host].send(data)

    def _on_signal(self, signum: int) -> None:
        if self.outcome.interrupted_by is not None:
            # A second Ctrl-C: no more grace, and no more waiting for our stdout either.
            self.writer.shed()
            self._stop(signal.SIGKILL, 0.0)
            return
        self.outcome.interrupted_by = signum
        if self.stopping:  # already (a failure): the ranks keep their grace, so under scancel
            return  # (SIGTERM to ranks and head alike) those still saving a checkpoint finish
        forwarded = signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM
        self._stop(forwarded, self.opts.grace)

    # -- stopping ----------------------------------------------------------------------------------
    def _fail(self, failure: Failure, at: float | None = None) -> None:
        """Record a failure (that happened ``at``, default now); the first stops the job."""
        if self.outcome.record_failure(failure):
            self.detected_at = time.monotonic()
            self.failed_at = min(at, self.detected_at) if at is not None else self.detected_at
            self._stop(signal.SIGTERM, self.opts.grace)

    def _host_lost(self, link: AgentLink, why: str, at: float | None = None) -> None:
        if link.index in self.done_hosts:
            return
        self.done_hosts.add(link.index)
        self.lost_hosts.add(link.index)
        self.fleet.drop(link)  # nothing more will come from it; never wait on a dead connection
        for r in self.outcome.ranks.values():
            if r.host == link.name and r.state in ("pending", "running"):
                r.state = "lost"
        if not self.stopping or self.outcome.failures:
            stderr = link.stderr_text().strip().splitlines()[-3:]
            detail = f" (agent stderr: {' | '.join(stderr)})" if stderr else ""
            self._fail(Failure(LOST_CODE, f"host {link.name}", why + detail), at=at)

    def _stop(self, sig: int, grace: float) -> None:
        if self.killed_hard:
            return
        self.killed_hard = sig == signal.SIGKILL
        self.stopping = True
        # The agents SIGKILL after `grace`; give them a little longer to report back.
        self._give_up_at = time.monotonic() + grace + max(5.0, 2 * self.opts.heartbeat)
        if not self.keep_agents:  # hosts still checking start nothing now; BYE ends them
            # (a round that may be followed waits for their answer: a late READY must not
            # count for the next round's SPEC)
            self.done_hosts.update(link.index for link in self.startup.waiting())
        for link in self._running():
            link.send_json(wire.Kind.KILL, {"signal": int(sig), "grace": grace})

