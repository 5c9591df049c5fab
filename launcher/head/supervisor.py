"""Runs one job over connected agents: start everywhere or nowhere, then supervise to the end.

Start-up is two-phase: every agent checks the SPEC (working directory, program) and answers
READY; only when all hosts are READY does any rank start, so a bad host starts nothing anywhere.
Then the supervisor serves PMI from the head's key-value space, and stops the whole job on the
first failure, on Ctrl-C/SIGTERM, on --timeout, or when a host falls silent.

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
from launcher.head.agent_link import AgentLink, Closed, Received
from launcher.head.options import SuperviseOptions
from launcher.head.outcome import Failure, JobOutcome, RankOutcome
from launcher.head.pmi_notes import PmiNotes
from launcher.head.progress import HANG_CODE, ProgressMonitor
from launcher.head.startup import Signalled, Startup, note_phase
from launcher.head.stdin import StdinForwarder
from launcher.output.sink import OutputSink
from launcher.output.writer import OutputWriter
from launcher.plan.job import JobPlan
from launcher.transport.stream import AgentStream

LOST_CODE = 255
KILLED_DRAIN_S = 2.0  # after a second Ctrl-C, how long output still queued may take


class Supervisor:
    def __init__(self, streams: Sequence[AgentStream], plan: JobPlan, sink: OutputSink,
                 opts: SuperviseOptions) -> None:
        self.events: queue.Queue[Any] = queue.Queue()
        self.writer = OutputWriter()
        self.links = [AgentLink(i, s, self.events,
                                lambda out: self.writer.put(out.rank, out.stream, out.data))
                      for i, s in enumerate(streams)]
        self.stdin = StdinForwarder(self.links[0])  # rank 0 is on the first host
        self.opts = opts
        self.plan = plan
        self._sink = sink
        self.outcome = JobOutcome({r.rank: RankOutcome(r.rank, hp.entry.name)
                                   for hp in plan.hosts for r in hp.ranks})
        self.kvs: Any = None  # launcher.pmi.kvs.KeyValueSpace when PMI is on
        self.stopping = False
        self.killed_hard = False
        self.done_hosts: set[int] = set()
        self.lost_hosts: set[int] = set()
        self._give_up_at = float("inf")
        self.pmi_notes = PmiNotes(opts.pmi_stall, self._say)
        self.progress = ProgressMonitor(opts, self._probe, self._say, sink.log_dir,
                                        time.monotonic())
        self.timings: dict[str, float] = {}
        self._draining = False

    # -- signals (installed by the CLI; run in the main thread) -----------------------------
    def on_signal(self, signum: int, _frame: Any = None) -> None:
        if self._draining:
            self.writer.abandon()  # the job is over; the user does not want to wait for output
            return
        self.events.put(Signalled(signum))

    # -- the whole job ------------------------------------------------------------------------
    def run(self, master: tuple[str | None, int | None] = (None, None)) -> JobOutcome:
        """The whole job: start-up (``master`` holds --master-addr/--master-port, None where
        rank 0's host chooses), supervision to the end, the output drained."""
        t0 = time.monotonic()
        if self.opts.pmi != "off":
            # Made while the agents boot: between the last READY and START it would delay
            # every rank (the import is tens of milliseconds on a loaded head).
            from launcher.pmi.kvs import KeyValueSpace

            self.kvs = KeyValueSpace(hosts=len(self.links), kvsname=self.plan.job_id)
        startup = Startup(self.links, self.events, self.opts)
        try:
            rendezvous = startup.prepare(self.plan, master)
        except BaseException:
            self._dismiss_all()
            raise
        self.writer.start(self._sink)
        startup.start(rendezvous, self.outcome, self._handle)
        self.stdin.start()
        self.timings.update(hello=startup.hello_at, ready=startup.ready_at,
                            running=time.monotonic())
        self._loop(t0)
        self.stdin.stop()
        self.timings["exit"] = time.monotonic()
        self._draining = True
        self.writer.close(KILLED_DRAIN_S if self.killed_hard else None)
        return self.outcome

    def _loop(self, t0: float) -> None:
        deadline = t0 + self.opts.timeout if self.opts.timeout else None
        last_beat = time.monotonic()
        while len(self.done_hosts) < len(self.links):
            now = time.monotonic()
            if now - last_beat >= self.opts.heartbeat:
                for link in self.links:
                    if link.index not in self.done_hosts and not link.send(
                            wire.encode(wire.Kind.HEARTBEAT)):
                        self._host_lost(link, "the stream to its agent broke")
                last_beat = now
            self._check_silence(now)
            self._check_pmi_stall(now)
            self._check_progress(now)
            if deadline is not None and now >= deadline and not self.stopping:
                self.outcome.timed_out = True
                self._stop(signal.SIGTERM, self.opts.grace)
            if self.stopping and now >= self._give_up_at and not self._output_holds():
                self._dismiss_all()
                break
            try:
                event = self.events.get(timeout=0.2)
            except queue.Empty:
                continue
            self._handle(event)
        self._dismiss_all()

    def _output_holds(self) -> bool:
        """Stopping waits for ranks whose output we are still writing (not after a 2nd Ctrl-C)."""
        return not self.killed_hard and any(
            link.held for link in self.links if link.index not in self.done_hosts)

    def _check_silence(self, now: float) -> None:
        limit = self.opts.heartbeat * self.opts.misses
        for link in self.links:
            if link.held:
                continue  # we stopped reading it (our stdout is slow): not the agent's silence
            if link.index not in self.done_hosts and now - link.last_heard > limit:
                self._host_lost(link, f"no heartbeat for {now - link.last_heard:.1f}s "
                                      "(host down or network cut?)")

    def _check_pmi_stall(self, now: float) -> None:
        """A barrier some hosts entered long ago: ask the others which ranks hold it up."""
        if self.kvs is None:
            return
        waiting = {h: self.links[h].name for h in self.kvs.waiting_hosts()}
        for host in self.pmi_notes.tick(now, waiting, self.kvs.epoch):
            self.links[host].send_json(wire.Kind.PMI, {"op": "stall_query"})

    def _check_progress(self, now: float) -> None:
        """Hang diagnosis and the live view; --hang-action abort stops the job."""
        live = {link.index for link in self.links if link.index not in self.done_hosts}
        found = self.progress.tick(now, live)
        if found is not None and self.opts.hang_action == "abort" and not self.stopping:
            where = ", ".join(f"rank {r}@{self.outcome.ranks[r].host}"
                              for r in found.culprit_ranks if r in self.outcome.ranks) or "job"
            self._fail(Failure(HANG_CODE, where, f"hung ({found.headline}); stopped by "
                               "--hang-action abort"))

    def _probe(self, body: dict[str, Any]) -> None:
        for link in self.links:
            if link.index not in self.done_hosts:
                link.send_json(wire.Kind.PROBE, body)

    def _say(self, text: str) -> None:
        self.writer.notice(text)  # in order with the ranks' stderr; never blocks the loop

    # -- events -----------------------------------------------------------------------------------
    def _handle(self, event: Any) -> None:
        if isinstance(event, Received):
            self._on_frame(self.links[event.host], event.frame)
        elif isinstance(event, Closed):
            link = self.links[event.host]
            if event.host not in self.done_hosts:
                self._host_lost(link, event.reason)
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
        elif kind is wire.Kind.STDIN_ACK:
            self.stdin.acked(int(frame.json().get("bytes", 0)))
        elif kind is wire.Kind.PMI:
            self._on_pmi(link, frame.json())
        elif kind is wire.Kind.PROGRESS:
            self.progress.on_progress(link.index, frame.json())
        elif kind is wire.Kind.DONE:
            self.done_hosts.add(link.index)
            link.send_json(wire.Kind.BYE)
        elif kind is wire.Kind.ERROR:
            body = frame.json()
            self._fail(Failure(LOST_CODE, f"host {link.name}",
                               f"{body.get('what')}: {body.get('why')}"))

    def _on_exit(self, body: dict[str, Any]) -> None:
        rank = int(body["rank"])
        self.writer.flush_rank(rank)
        failure = self.outcome.rank_exited(rank, int(body["code"]), body.get("signal"),
                                           self.stopping)
        if failure is not None:
            self._fail(failure)

    def _on_pmi(self, link: AgentLink, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "abort":
            if self.outcome.abort is None:
                self.outcome.abort = Failure(int(msg.get("code", 1)),
                                             f"rank {msg.get('rank')}@{link.name}",
                                             f"MPI_Abort: {msg.get('message') or 'no message'}")
                self._stop(signal.SIGTERM, self.opts.grace)
            return
        if op in ("stall", "stall_state", "unsupported"):
            notes = self.pmi_notes
            if op == "stall":
                notes.agent_stall(link.name, msg, bool(self.kvs and self.kvs.waiting_hosts()))
            elif op == "stall_state":
                notes.answer(link.index, msg)
            else:
                notes.unsupported(msg.get("rank"), link.name, str(msg.get("feature")))
            return
        if op == "rank_failed":
            if self.stopping:
                return  # a consequence of our own stop, not a new failure
            rank = int(msg["rank"])
            self._fail(Failure(1, f"rank {rank}@{link.name}", str(msg.get("reason")), rank,
                               inferred=True))
            return
        if self.kvs is None:
            return
        for host, reply in self.kvs.handle(link.index, msg):
            self.links[host].send_json(wire.Kind.PMI, reply)

    def _on_signal(self, signum: int) -> None:
        if self.outcome.interrupted_by is not None or self.stopping:
            # A second Ctrl-C: no more grace, and no more waiting for our stdout either.
            if self.outcome.interrupted_by is None:
                self.outcome.interrupted_by = signum
            self.writer.shed()
            self._stop(signal.SIGKILL, 0.0)
            return
        self.outcome.interrupted_by = signum
        forwarded = signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM
        self._stop(forwarded, self.opts.grace)

    # -- stopping ----------------------------------------------------------------------------------
    def _fail(self, failure: Failure) -> None:
        if self.outcome.record_failure(failure):
            self._stop(signal.SIGTERM, self.opts.grace)

    def _host_lost(self, link: AgentLink, why: str) -> None:
        if link.index in self.done_hosts:
            return
        self.done_hosts.add(link.index)
        self.lost_hosts.add(link.index)
        link.close()
        link.stream.abort()  # nothing more will come from it; do not wait on a dead connection
        for r in self.outcome.ranks.values():
            if r.host == link.name and r.state in ("pending", "running"):
                r.state = "lost"
        if not self.stopping or self.outcome.failures:
            stderr = link.stderr_text().strip().splitlines()[-3:]
            detail = f" (agent stderr: {' | '.join(stderr)})" if stderr else ""
            self._fail(Failure(LOST_CODE, f"host {link.name}", why + detail))

    def _stop(self, sig: int, grace: float) -> None:
        if self.killed_hard:
            return
        self.killed_hard = sig == signal.SIGKILL
        self.stopping = True
        # The agents SIGKILL after `grace`; give them a little longer to report back.
        self._give_up_at = time.monotonic() + grace + max(5.0, 2 * self.opts.heartbeat)
        for link in self.links:
            if link.index not in self.done_hosts:
                link.send_json(wire.Kind.KILL, {"signal": int(sig), "grace": grace})

    def _dismiss_all(self) -> None:
        """BYE and close every stream; agents still holding ranks SIGKILL them on BYE/EOF."""
        for link in self.links:
            link.send_json(wire.Kind.BYE)
            link.close()
        deadline = time.monotonic() + 5.0
        for link in self.links:
            if link.index in self.lost_hosts:
                continue
            if link.stream.wait(timeout=max(0.0, deadline - time.monotonic())) is None:
                link.stream.kill()

