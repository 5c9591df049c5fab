"""The per-host agent: `python -m launcher.agent` (a constant command; the job comes as data).

It says HELLO, checks the SPEC (usually already waiting in its stdin: READY or ERROR), starts its
host's ranks on START, relays their output, exit statuses and PMI traffic, and stops every rank
(SIGTERM, grace, SIGKILL to each rank's process group) when the head says KILL or BYE, when the
stream from the head closes, or when the head falls silent for `misses` heartbeat intervals. It
exits 0 after BYE when every rank of its host exited 0, else 1 (a pod restarts). Under rounds
(`--max-restarts`) it stays after its ranks while the head's heartbeats last: a new SPEC starts the
next round (a spare's has no ranks: a check). It imports only what it needs (no `typing`,
`pathlib`, `secrets`): its start-up delays the ranks.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import time
from collections.abc import Callable

import workerenv
from launcher import netroute, wire
from launcher.agent import facts
from launcher.agent.head_link import Eof, HeadLink
from launcher.agent.host import Host
from launcher.agent.progress import ProgressReporter
from launcher.agent.ranks import RankExited, RankProcess, check_job
from launcher.agent.stdin import RankStdin
from launcher.plan.environment import rank_environment

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from typing import Any

HELLO_SILENCE_S = 60.0   # before the SPEC arrives, how long the head may stay silent
AFTER_DONE_S = 30.0      # after DONE, how long to wait for BYE before leaving anyway
EOF_GRACE_S = 3.0        # the head is gone: short grace, nobody is waiting for a clean exit
# Set to the interface that reaches MASTER_ADDR unless the user set them (workerenv.py).
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class Agent:
    def __init__(self, connect: Callable[[queue.Queue[Any]], HeadLink],
                 relay_connect: Callable[[dict[str, Any]], Any] | None = None,
                 host: Host | None = None) -> None:
        """``connect`` makes the link to the head from the agent's event queue (stdin/stdout,
        a rendezvous socket; a pair of pipes in the core tests); ``relay_connect``, as a
        relay, a child's stream from its SUBTREE node (default: over SSH;
        `launcher.tree.relay`); ``host``, what starts ranks and reads and cleans the host
        (`launcher.agent.host`; the simulated cluster gives its own)."""
        self.relay_connect = relay_connect
        self.host = host or Host()
        self.events: queue.Queue[Any] = queue.Queue()
        self.link = connect(self.events)
        self.link.take_on_arrival(self._pmi_on_arrival)
        self.ranks: dict[int, RankProcess] = {}
        self.spec: wire.AgentSpec | None = None
        self.job_env: dict[str, str] = {}  # what START adds to every rank (MASTER_ADDR/PORT)
        self.base_env: dict[str, str] = {}  # START's forwarded variables, under the contract's
        self.host_env: dict[str, str] = {}  # this host's environment, as the SPEC found it
        self.interface: str | None = None  # the NIC that reaches MASTER_ADDR
        self.pmi: Any = None  # launcher.agent.pmi_sockets.PmiSockets when PMI is on
        self.stdin: RankStdin | None = None  # rank 0's stdin, on rank 0's host
        self.interval = wire.Watch.heartbeat  # until the SPEC sets the job's
        self.silence_limit = HELLO_SILENCE_S
        self.last_sent = time.monotonic()
        self.kill_at: float | None = None
        self.leave_at: float | None = None
        self.exit_code = 0
        self.started = False  # a rank started: descendants from now on belong to the job
        self.progress: ProgressReporter | None = None  # the ranks' progress records
        self.relay: Any = None  # launcher.tree.relay.Relay: this host starts a subtree
        self.head_gone = False  # its stream ended or fell silent (not BYE)

    # -- main loop --------------------------------------------------------------------------
    def run(self) -> int:
        self.link.send_json(wire.Kind.HELLO, facts.hello())
        while True:
            now = time.monotonic()
            if self._deadlines(now):
                return self.exit_code
            try:
                event = self.events.get(timeout=self._wait_time(now))
            except queue.Empty:
                continue
            if isinstance(event, wire.Frame):
                if self._on_frame(event):
                    return self.exit_code
            elif isinstance(event, RankExited):
                self._on_exit(event)
            elif isinstance(event, Eof):
                self.head_gone = True
                self._stop(signal.SIGTERM, EOF_GRACE_S)
                return self._leave(1)  # the head went away without BYE: nobody said done

    def _wait_time(self, now: float) -> float:
        """Until the next of `_deadlines`' timers is due: the heartbeat, the head's silence
        limit (counted from what the reader thread last stamped), the SIGKILL after a grace,
        leaving, the progress records' reading. Anything else wakes the loop through its
        queue. Not a poll every second: thousands of simulated agents sharing a process
        spent most of their CPU on such wake-ups (`bench.sim_scale`), and a real host's
        agent sleeps through its ranks' run but for its heartbeats."""
        due = [self.last_sent + self.interval, self.link.heard_at + self.silence_limit]
        for at in (self.kill_at, self.leave_at):
            if at is not None:
                due.append(at)
        if self.progress is not None and self.ranks:
            due.append(self.progress.next_due)
        return max(0.01, min(due) - now)

    def _deadlines(self, now: float) -> bool:
        """Heartbeats and timers; True when the agent must leave now."""
        if now - self.last_sent >= self.interval:
            self.link.send(wire.encode(wire.Kind.HEARTBEAT))
            self.last_sent = now
        if self.kill_at is not None and now >= self.kill_at:
            self._signal_all(signal.SIGKILL)
            self.kill_at = None
        silent = now - self.link.heard_at  # stamped on arrival (`HeadLink`)
        if silent > self.silence_limit:
            # The head is gone or cut off: nobody will ever collect these ranks. Said first, in
            # case only our way back still works: the head then names this, not their SIGTERM.
            self.link.send_json(wire.Kind.ERROR, {
                "what": "the agent heard nothing from the head",
                "why": f"silent for {silent:.1f}s (limit {self.silence_limit:g}s); its ranks "
                       "were stopped"})
            self.head_gone = True
            self._stop(signal.SIGTERM, EOF_GRACE_S)
            self._leave(1)
            return True
        if self.progress is not None and self.ranks:
            self.progress.tick(now, self._pids())
        if self.leave_at is not None and now >= self.leave_at:
            self._leave(self.exit_code)
            return True
        return False

    # -- frames from the head -----------------------------------------------------------------
    def _on_frame(self, frame: wire.Frame) -> bool:
        kind = frame.kind
        if kind is wire.Kind.ROUTED and self.relay is not None:
            self.relay.down(frame)
        elif kind is wire.Kind.SUBTREE and self.relay is None:
            from launcher.agent.writer import FrameWriter
            from launcher.tree.relay import Relay

            self.relay = Relay(frame.json(), self.link, self._pmi_down, self.relay_connect,
                               writer=FrameWriter,
                               keys_folder=lambda: self.host.records_folder("relay"))
            self.relay.start()
        elif kind is wire.Kind.SPEC:
            self._on_spec(frame.json())
        elif kind is wire.Kind.START and self.spec is not None:
            self._start_all(self.spec, frame.json())
        elif kind is wire.Kind.KILL:
            body = frame.json()
            self._stop(int(body.get("signal", signal.SIGTERM)),
                       float(body.get("grace", wire.Watch.grace)))
        elif kind is wire.Kind.STDIN:
            self._on_stdin(frame.payload)
        elif kind is wire.Kind.PMI:
            self._pmi_from_head(frame.json())  # decoded once: a fence's answer holds every card
        elif kind is wire.Kind.PROBE and self.progress is not None:
            self.progress.probe(frame.json(), self._pids())
        elif kind is wire.Kind.QUERY:
            self.link.send_json(wire.Kind.REPLY, facts.answer(frame.json()))
        elif kind in (wire.Kind.BYE, wire.Kind.REFUSE):  # REFUSE: the head gave up before START
            if kind is wire.Kind.REFUSE:
                sys.stderr.write(f"dtrain agent: {frame.json().get('why')}\n")
            self._stop(signal.SIGKILL, 0.0)
            self._leave(self.exit_code if kind is wire.Kind.BYE else 1)
            return True
        return False

    def _on_spec(self, body: dict[str, Any]) -> None:
        t0 = time.monotonic()
        if self.ranks:  # the head sends a round's SPEC only once the last round is done
            self.link.send_json(wire.Kind.ERROR, {"what": "SPEC while ranks run"})
            return
        self._end_round()
        try:
            spec = wire.AgentSpec.from_json(body)
        except wire.WireError as exc:
            self.link.send_json(wire.Kind.ERROR, {"what": "unreadable SPEC", "why": str(exc),
                                                  "fix": "use one dtrain version everywhere"})
            return
        self.spec, self.leave_at, self.exit_code = spec, None, 0
        if self.relay is not None:
            self.relay.own_spec(body)
        self.interval, self.silence_limit = spec.watch.heartbeat, spec.watch.limit
        # The host's environment copied once a round: each rank's is composed from it
        # (`os.environ` decodes every variable on each walk: a tenth of a simulated host's
        # start-up, `bench.sim_scale`).
        self.host_env = dict(os.environ)
        problem = check_job(spec.cwd, spec.argv[0], rank_environment(self.host_env,
                                                                     spec.check_env))
        if problem:
            self.link.send_json(wire.Kind.ERROR, problem)
            return
        ranks = [r.rank for r in spec.ranks]
        if spec.progress_interval is not None:
            self.progress = ProgressReporter(
                spec.job_id, spec.ranks[0].env.get(workerenv.HOST, "") if ranks else "",
                ranks, spec.progress_interval,
                lambda body: self.link.send_json(wire.Kind.PROGRESS, body),
                lambda: self.pmi.proxy.fenced if self.pmi is not None else frozenset(),
                self.host)
        if spec.pmi.mode != "off":
            from launcher.agent.pmi_sockets import PmiSockets

            self.pmi = PmiSockets(
                mode=spec.pmi.mode, ranks=ranks, world_size=spec.pmi.world_size,
                kvsname=spec.pmi.kvsname, process_mapping=spec.pmi.process_mapping,
                stall_after=spec.pmi.stall,
                send_head=self._pmi_up)
        self.link.send_json(wire.Kind.READY, {"ranks": len(spec.ranks),
                                               **facts.rendezvous(spec.probe),
                                               "check_s": round(time.monotonic() - t0, 4)})

    def _pmi_up(self, msg: dict[str, Any]) -> None:
        """The PMI proxy's message to the head; a relay's own barrier joins its subtree's,
        and its own get is answered by it when it holds the card."""
        if self.relay is not None and msg.get("op") == "barrier_in":
            self.relay.own_barrier(msg)
        elif self.relay is not None and msg.get("op") == "get" and self.relay.own_get(msg):
            pass  # a card of the relay's subtree, answered by the relay
        else:
            self.link.send_json(wire.Kind.PMI, msg)

    def _pmi_on_arrival(self, frame: wire.Frame) -> bool:
        """On the link's reader thread: a PMI answer goes straight to the PMI thread (its
        inbox is thread-safe), not through this loop (`HeadLink.take_on_arrival`). A relay's
        go through the loop, which owns the relay."""
        pmi = self.pmi
        if frame.kind is not wire.Kind.PMI or pmi is None or self.relay is not None:
            return False
        pmi.from_head(frame.json())
        return True

    def _pmi_from_head(self, msg: dict[str, Any]) -> None:
        if self.relay is not None and "hosts" in msg:
            self.relay.fence_out(msg)  # a fence this relay answered for its subtree
        elif self.pmi is not None:
            self.pmi.from_head(msg)

    def _pmi_down(self, msg: dict[str, Any]) -> None:
        if self.pmi is not None:
            self.pmi.from_head(msg)

    def _rank_env(self, rank: wire.RankStart) -> dict[str, str]:
        env = rank_environment(self.host_env, {**self.base_env, **rank.env, **self.job_env})
        if self.interface:
            for name in SOCKET_IFNAME_VARS:
                env.setdefault(name, self.interface)
        if self.pmi is not None:
            env.update(self.pmi.rank_env(rank.rank))
        if self.progress is not None:
            env.update(self.progress.rank_env(rank.rank, env))
        return env

    def _pids(self) -> dict[int, int]:
        return {rank: rp.pid for rank, rp in self.ranks.items()}

    # -- ranks ---------------------------------------------------------------------------------
    def _start_all(self, spec: wire.AgentSpec, start: dict[str, Any]) -> None:
        """START: MASTER_ADDR/PORT (env), the forwarded variables (base: secrets, so only here)."""
        self.job_env, self.base_env = ({str(k): str(v) for k, v in (start.get(key) or {}).items()}
                                       for key in ("env", "base"))
        master = self.job_env.get("MASTER_ADDR")
        self.interface = netroute.interface_for(master) if master else None
        t0 = time.monotonic()
        started, failure = self._spawn_all(spec)
        self.started = bool(started)
        spawn_s = round(time.monotonic() - t0, 4)  # for `dtrain launch --timings`
        for rp in started:  # watched only now: see RankProcess.watch
            rp.watch(self.link.send_output, self.events)  # pumps block while the head lags
            if rp.rank == 0:
                self.stdin = RankStdin(rp.proc.stdin, self._ack_stdin)
            self.link.send_json(wire.Kind.STARTED, {"rank": rp.rank, "pid": rp.pid,
                                                    "spawn_s": spawn_s})
        if failure is not None:
            self.link.send_json(wire.Kind.ERROR, {
                "what": "rank did not start", "why": failure,
                "fix": "check the program and the working directory on this host"})
            self._stop(signal.SIGTERM, spec.watch.grace)

    def _spawn_all(self, spec: wire.AgentSpec) -> tuple[list[RankProcess], str | None]:
        """Start this host's ranks in order; stops at the first that cannot start (why)."""
        started: list[RankProcess] = []
        for rank_start in spec.ranks:
            rank = rank_start.rank
            fds = self.pmi.rank_fds(rank) if self.pmi else []
            try:
                rp = self.host.start_rank(rank, spec.argv, self._rank_env(rank_start),
                                          spec.cwd, fds, stdin_pipe=rank == 0)
            except OSError as exc:
                return started, f"rank {rank}: {exc}"
            if self.pmi:
                self.pmi.started(rank)
            self.ranks[rank] = rp
            started.append(rp)
        return started, None

    def _on_stdin(self, data: bytes) -> None:
        """The head's stdin for rank 0 (an empty chunk is EOF); never blocks the loop."""
        if self.stdin is not None:
            self.stdin.put(data)
        elif data:
            self._ack_stdin(len(data))  # rank 0 did not start here: drop, but free the head

    def _ack_stdin(self, count: int) -> None:
        self.link.send_json(wire.Kind.STDIN_ACK, {"bytes": count})

    def _on_exit(self, ev: RankExited) -> None:
        rp = self.ranks.pop(ev.rank, None)
        self.exit_code = self.exit_code or int(ev.code != 0)  # 0 only if every rank exited 0
        if self.pmi is not None:
            self.pmi.exited(ev.rank)
        self.link.send_json(wire.Kind.EXIT, {"rank": ev.rank, "code": ev.code, "signal": ev.signal,
                                             "sent": rp.sent_report() if rp else [],
                                             **(self.progress.error(ev) if self.progress else {})})
        if rp is not None:
            rp.signal_group(signal.SIGKILL)  # leftovers of the rank (it is done, they are not)
        if not self.ranks:
            # setsid children and orphans outlive their groups; a relay's links stay
            self.host.kill_strays(keep=self._links(), reaping=self._reaping())
            self.kill_at = None
            if self.progress is not None:
                self.progress.final()
            self.link.send_json(wire.Kind.DONE)
            rounds = self.spec is not None and self.spec.rounds  # another round may follow
            self.leave_at = None if rounds else time.monotonic() + AFTER_DONE_S

    def _stop(self, sig: int, grace: float) -> None:
        if not self.ranks:
            return
        self._signal_all(sig)
        if sig != signal.SIGKILL:
            self._signal_all(signal.SIGCONT)  # a stopped rank (SIGSTOP) acts on it once awake
            deadline = time.monotonic() + grace
            self.kill_at = deadline if self.kill_at is None else min(self.kill_at, deadline)

    def _signal_all(self, sig: int) -> None:
        for rp in list(self.ranks.values()):
            rp.signal_group(sig)
        if not self.started:
            return  # no job ever ran here: none of this process's descendants belongs to one
        # What left the ranks' process groups (setsid) is found as the agent's descendants.
        keep = frozenset(rp.pid for rp in self.ranks.values()) | self._links()
        if sig == signal.SIGKILL:
            self.host.kill_strays(keep=keep, reaping=self._reaping())
        else:
            self.host.signal_descendants(sig, keep=keep)

    def _reaping(self) -> bool:
        """Whether another thread may reap a child of the agent now: a rank's reaper, the
        reaper of a relay's link that is a process (`ssh`; a paramiko channel is none).
        `Host.kill_strays` reads the machine's whole process table then: 0.2-0.4 s at each
        relay's end on 64 namespace hosts, twice, on the tree's exit tail (`bench.hosts_scale`)."""
        return bool(self.ranks) or (self.relay is not None and self.relay.spawns)

    def _links(self) -> frozenset[int]:
        """A relay's `ssh` processes to the hosts below it: never a job's leftovers."""
        return self.relay.transport_pids() if self.relay is not None else frozenset()

    def _leave(self, code: int) -> int:
        """Leave for good: nothing of the job may outlive the agent."""
        deadline = time.monotonic() + EOF_GRACE_S
        while self.ranks and time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(event, RankExited):
                self._on_exit(event)
        self._signal_all(signal.SIGKILL)
        self._end_round()
        self.exit_code = code
        return code

    def _end_round(self) -> None:  # what one round's SPEC set up: PMI, shm, progress records
        if self.pmi is not None:
            self.pmi.close()
            self.pmi.remove_shared_memory()
            self.pmi = None
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        self.stdin = None

