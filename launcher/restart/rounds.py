"""A job as rounds of the head's supervisor over agents that stay connected (--max-restarts).

Every host (spares too) is connected once, at the start; a spare gets a SPEC without ranks, so
its agent checks the job's working directory and program (READY or ERROR) and then only
exchanges heartbeats. Each round is a `launcher.head.supervisor.Supervisor` over the links of
its hosts, which leaves the agents connected when its ranks are gone. After a failed round the
policy (`policy`) decides whether to restart, blame (`blame`) names the hosts, the pool
(`pool`) places the next round; after the back-off the agents of the hosts that stay start
their ranks again on the same connection (a new SPEC), a spare's agent takes a place, and a
lost host that stays, or a spare whose agent fell silent (said when it happened), is connected
again. Hosts that leave are dismissed at once, so nothing of
the job stays on them. Ctrl-C (or SIGTERM, SIGHUP) during the back-off or a restart's start-up
ends the job (128+N) and dismisses every agent; `launcher.launch` prints the report.
"""

from __future__ import annotations

import queue
import signal
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from launcher import wire
from launcher.errors import AgentError, ConnectError
from launcher.head.agent_link import AgentLink, Closed, Fleet, Received
from launcher.head.options import SuperviseOptions
from launcher.head.outcome import Failure, JobOutcome
from launcher.head.startup import Signalled, spec_of
from launcher.head.supervisor import Supervisor
from launcher.hosts.selection import HostSlots
from launcher.output.sink import OutputSink
from launcher.plan.job import JobPlan, RoundInfo, make_plan
from launcher.restart import goodput, policy
from launcher.restart.blame import Blame, blame
from launcher.restart.goodput import RoundRecord
from launcher.restart.pool import HostPool, JobEnds, NextRound
from launcher.restart.vetting import vet
from launcher.transport.stream import AgentStream

#: Opens an agent stream on each host (or says why not), in order: the launch's transport.
Connect = Callable[[Sequence[HostSlots]], "list[AgentStream | ConnectError]"]
#: The output sink of a round: (its plan, its log folder or None).
SinkFor = Callable[[JobPlan, "Path | None"], OutputSink]


@dataclass(frozen=True)
class RoundsSetup:
    """What every round of one job shares (`launcher.launch` builds it)."""

    argv: tuple[str, ...]
    cwd: str
    job_id: str
    base_env: Mapping[str, str]
    supervise: SuperviseOptions
    restart: policy.RestartOptions
    master: tuple[str | None, int | None]
    log_dir: Path | None
    connect: Connect
    sink_for: SinkFor


@dataclass
class JobEnd:
    """How the job ended: its last round's outcome and supervisor, every round's record."""

    outcome: JobOutcome
    last: Supervisor
    tail: Callable[[int], list[str]]
    """The last stderr lines of a rank of the last round (for the exit report)."""
    records: list[RoundRecord] = field(default_factory=list)
    why: str = ""
    """Why no further round ran, when the job failed ("" when it succeeded)."""
    wall_s: float = 0.0

    def report(self, log_dir: Path | None, out: TextIO) -> None:
        """The rounds table and goodput (--max-restarts), also as ``goodput.json``."""
        rep = goodput.report(self.records, self.wall_s)
        if self.why:
            out.write(f"dtrain: not restarting: {self.why}\n")
        for line in goodput.render(rep):
            out.write(f"dtrain: {line}\n")
        if log_dir is not None:
            try:
                (log_dir / "goodput.json").write_text(goodput.dumps(rep))
            except OSError as exc:
                out.write(f"dtrain: warning: cannot write {log_dir / 'goodput.json'}: "
                          f"{exc.strerror}\n")
        out.flush()


class Rounds:
    def __init__(self, setup: RoundsSetup, active: Sequence[HostSlots],
                 spares: Sequence[HostSlots]) -> None:
        self.setup = setup
        self.fleet = Fleet()
        self.fleet.on_lost = self._lost
        self.pool = HostPool(active, spares, min_nodes=setup.restart.min_nodes,
                             exclude_after=setup.restart.exclude_after)
        self.links: dict[str, AgentLink] = {}  # host name -> its agent's link
        self.records: list[RoundRecord] = []
        self.current: Supervisor | None = None  # the round running now, if one is
        self.tail: Callable[[int], list[str]] = lambda rank: []  # the last round's sink's

    def on_signal(self, signum: int, _frame: Any = None) -> None:
        """Installed for SIGINT/SIGTERM/SIGHUP: the running round's, else the back-off's."""
        if self.current is not None:
            self.current.on_signal(signum)
        else:
            self.fleet.events.put(Signalled(signum))

    def adopt(self, hosts: Sequence[HostSlots], results: Sequence[AgentStream | ConnectError],
              early: Collection[int] = ()) -> None:
        """Take the agents started on ``hosts`` (every host, then the spares): a host that
        could not be reached ends the launch as without restarts (nothing was started
        anywhere); a spare that could not is left out, said once. Spares check the job. The
        hosts numbered in ``early`` have their first round's SPEC (`launcher.head.early`)."""
        active = set(self.pool.active)  # a set: a list's `in` was N^2 compares at 1,024 hosts
        errors = [r for h, r in zip(hosts, results, strict=True)
                  if isinstance(r, ConnectError) and h in active]
        if errors:
            for r in results:
                if not isinstance(r, ConnectError):
                    r.close()
                    if r.connection is not None:
                        r.connection.close()
            raise errors[0] if len(errors) == 1 else ConnectError(
                f"{len(errors)} hosts could not be reached", "",
                "; ".join(str(e) for e in errors), "nothing was started anywhere")
        plan = self._plan(self.pool.active, RoundInfo())
        check = wire.encode_json(wire.Kind.SPEC,
                                 spec_of(plan, None, self.setup.supervise).to_json())
        for number, (host, result) in enumerate(zip(hosts, results, strict=True)):
            name = host.entry.name
            if isinstance(result, ConnectError):
                self.pool.lose_spare(name)
                self.say(f"spare {name} not reached: {result}; tried again before the job "
                         "gives up for want of a spare")
                continue
            self.links[name] = self.fleet.add(result)
            self.links[name].early_spec = number in early
            if host not in active:
                self.links[name].send(check)

    def run(self, started: float) -> JobEnd:
        """Rounds until one ends the job; every agent is dismissed on the way out."""
        try:
            return self._rounds(started)
        finally:
            self.fleet.dismiss(self.fleet.links)

    def _rounds(self, started: float) -> JobEnd:
        opts, hosts, info = self.setup.restart, list(self.pool.active), RoundInfo()
        initial = sum(len(h.slots) for h in hosts)
        while True:
            sup = self._round(hosts, info, started)
            end = policy.RoundEnd(sup.outcome.exit_code, sup.outcome.interrupted_by,
                                  sup.outcome.timed_out)
            decision = policy.decide(end, opts, info.number)
            found = blame(sup.outcome, lost={link.name for link in sup.links
                                             if link.index in sup.lost_hosts}, hung=sup.hung)
            record = self.records[-1]
            if found is not None:
                record.cause, record.blamed, record.detail = found.cause, found.hosts, \
                    found.detail
            if not decision.restart:
                return self._end(sup, started, decision.why if end.exit_code else "")
            assert found is not None  # a round that restarts failed
            nxt = self._place(found)
            if isinstance(nxt, JobEnds):
                return self._end(sup, started, nxt.why)
            record.change = nxt.describe()
            wait = policy.backoff(opts, info.number + 1)
            _say(f"round {info.number} failed ({found.cause}: {found.detail}); restart "
                 f"{info.number + 1} of {opts.max_restarts} in {wait:g}s: {nxt.describe()}")
            signum = self.tend(wait)
            if signum is not None:
                sup.outcome.interrupted_by = signum
                return self._end(sup, started, "")
            hosts = list(nxt.hosts)
            info = RoundInfo(info.number + 1, opts.max_restarts,
                             f"{found.cause}: {', '.join(found.hosts)}", initial)

    def _round(self, hosts: list[HostSlots], info: RoundInfo, started: float) -> Supervisor:
        plan = self._plan(hosts, info)
        folder = self.setup.log_dir
        if folder is not None and self.setup.restart.enabled:
            folder = folder / f"round-{info.number}"
        sink = self.setup.sink_for(plan, folder)
        self.tail = sink.tail
        sup = Supervisor(self.fleet, [self.links[h.entry.name] for h in hosts], plan, sink,
                         self.setup.supervise, keep_agents=True, stdin=info.number == 0)
        record = RoundRecord(info.number, tuple(h.entry.name for h in hosts), time.monotonic())
        self.records.append(record)
        self.current = sup
        try:
            sup.run(self.setup.master, started=started)
        except (AgentError, ConnectError) as exc:
            if not info.number:
                raise  # the first round fails to start as a launch without restarts does
            # A later round that cannot start fails like a lost host: blamed, replaced.
            sink.close()
            sup.outcome.record_failure(Failure(exc.exit_code, exc.where, exc.why))
        except KeyboardInterrupt:  # a signal while a later round started
            if not info.number:
                raise
            sink.close()
            sup.outcome.interrupted_by = signal.SIGINT
        finally:
            self.current = None
        steps = sup.progress.round_steps()
        record.running_at = sup.timings.get("running")
        record.first_step, record.trained_at = steps.first_step, steps.trained_at
        record.last_step, record.last_step_at = steps.last_step, steps.last_step_at
        record.failed_at, record.detected_at = sup.failed_at, sup.detected_at
        record.stopped_at = sup.timings.get("exit", time.monotonic())
        record.exit_code = sup.outcome.exit_code
        return sup

    def _plan(self, hosts: list[HostSlots], info: RoundInfo) -> JobPlan:
        s = self.setup
        return make_plan(hosts, argv=s.argv, cwd=s.cwd, job_id=s.job_id, base_env=s.base_env,
                         restart=RoundInfo(info.number, s.restart.max_restarts, info.cause,
                                           info.initial_world), grace=s.supervise.grace)

    def _place(self, found: Blame) -> NextRound | JobEnds:
        """The next round's hosts, each with a live, checked agent (else placed again)."""
        for name, link in list(self.links.items()):
            if self.fleet.checked.get(link.index):
                self.pool.refuse_spare(name)
            elif not link.alive:
                self.pool.lose_spare(name)  # said when it happened (`_lost`)
        nxt = self.pool.next_round(found)
        failed: set[str] = set()  # hosts that could not join this placement: tried once each
        while isinstance(nxt, NextRound):
            for name in [old for old, _ in nxt.replaced] + list(nxt.dropped):
                if name in self.links:  # out of the job: nothing of it may stay there
                    self.fleet.release(self.links.pop(name))
            problem = vet(self, nxt)
            if problem is None:
                return nxt
            if failed.issuperset(problem.hosts):  # without --exclude-after: no end otherwise
                return JobEnds(f"{problem.detail}; no host left to take its place was not "
                               "tried already. Add spare hosts or bring the hosts back")
            failed.update(problem.hosts)
            found = problem
            nxt = self.pool.next_round(found)
        return nxt

    def tend(self, seconds: float, done: Callable[[], bool] = lambda: False) -> int | None:
        """Between rounds: keep every agent alive (heartbeats, their events) for ``seconds``
        or until ``done()``; a signal ends the wait early (its number)."""
        deadline = time.monotonic() + seconds
        beat_at = 0.0
        opts = self.setup.supervise
        while True:
            now = time.monotonic()
            if now >= deadline or done():
                return None
            beat = now - beat_at >= opts.heartbeat
            beat_at = now if beat else beat_at
            self.fleet.tend_idle({}, now, beat=beat, limit=opts.heartbeat * opts.misses)
            try:
                event = self.fleet.events.get(timeout=min(0.2, deadline - now))
            except queue.Empty:
                continue
            if isinstance(event, Signalled):
                return event.signum
            if isinstance(event, Received | Closed):
                self.fleet.idle_event(event)

    def say(self, text: str) -> None:
        """One line on stderr: through the running round's writer (in order with the ranks'
        output), else directly."""
        if self.current is not None:
            self.current.writer.notice(text)
        else:
            _say(text)

    def _lost(self, link: AgentLink, why: str) -> None:
        """A link of no round is gone (`Fleet.on_lost`): a spare's loss is said at once."""
        if self.links.get(link.name) is link and self.pool.is_spare(link.name):
            self.pool.lose_spare(link.name)
            self.say(f"spare {link.name} lost: {why}; connected again before it takes a place")

    def _end(self, sup: Supervisor, started: float, why: str) -> JobEnd:
        return JobEnd(sup.outcome, sup, self.tail, self.records, why,
                      time.monotonic() - started)


def _say(text: str) -> None:
    sys.stderr.write(f"dtrain: {text}\n")
    sys.stderr.flush()
