"""Job start-up over connected agents: HELLO from all, rendezvous address, SPEC/READY, START.

Nothing starts anywhere until every agent has checked its SPEC and answered READY.
"""

from __future__ import annotations

import queue
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from launcher import wire
from launcher.agent.facts import route_source
from launcher.agentlink import AgentLink, Closed, Received
from launcher.errors import AgentError
from launcher.outcome import JobOutcome
from launcher.plan import JobPlan


class Startup:
    def __init__(self, links: Sequence[AgentLink], events: queue.Queue[Any], opts: Any) -> None:
        self.links = list(links)
        self.events = events
        self.opts = opts
        self.deadline = time.monotonic() + opts.launch_timeout

    def prepare(self, build_plan: Callable[[str | None, int | None], JobPlan],
                master: tuple[str | None, int | None]) -> JobPlan:
        """HELLO from all, rendezvous address, SPEC to all, READY from all.

        ``master`` holds the user's --master-addr/--master-port; a None is chosen here.
        """
        self._gather(wire.Kind.HELLO, "say hello", lambda link, body: setattr(link, "hello", body))
        for link in self.links:
            if link.hello.get("protocol") != wire.PROTOCOL_VERSION:
                raise AgentError("agent speaks another protocol", f"host {link.name}",
                                 f"head {wire.PROTOCOL_VERSION}, "
                                 f"agent {link.hello.get('protocol')} "
                                 f"(dtrain {link.hello.get('dtrain')})",
                                 "install the same dtrain version on every host")
        addr, port = master
        plan = build_plan(addr or self._master_addr(), port or self._free_port())
        for link, host_plan in zip(self.links, plan.hosts, strict=True):
            link.send_json(wire.Kind.SPEC, self._spec(plan, host_plan))
        self._gather(wire.Kind.READY, "check the job", lambda *_: None)
        return plan

    def start(self, outcome: JobOutcome, handle: Callable[[Any], None]) -> None:
        """START everywhere, then feed events to the supervisor until every rank has started."""
        for link in self.links:
            link.send_json(wire.Kind.START)
        while any(r.state == "pending" for r in outcome.ranks.values()):
            if time.monotonic() > self.deadline or outcome.failures:
                return
            try:
                handle(self.events.get(timeout=0.2))
            except queue.Empty:
                pass
            try:
                self._check_silence({link.index for link in self.links}, "start its ranks")
            except AgentError as exc:
                index = next(link.index for link in self.links if link.name in exc.where)
                handle(Closed(index, exc.why))

    def _spec(self, plan: JobPlan, host_plan: Any) -> dict[str, Any]:
        return {
            "job_id": plan.job_id,
            "argv": list(plan.argv),
            "cwd": plan.cwd,
            "ranks": [{"rank": r.rank, "env": plan.rank_env(r)} for r in host_plan.ranks],
            "heartbeat": self.opts.heartbeat,
            "misses": self.opts.misses,
            "grace": self.opts.grace,
            "pmi": {
                "mode": self.opts.pmi,
                "kvsname": plan.job_id,
                "world_size": plan.world_size,
                "process_mapping": plan.process_mapping,
                "stall": self.opts.pmi_stall,
            },
        }

    def _gather(self, kind: wire.Kind, doing: str,
                on_body: Callable[[AgentLink, dict], None]) -> None:
        waiting = {link.index for link in self.links}
        while waiting:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                names = ", ".join(self.links[i].name for i in sorted(waiting))
                raise AgentError(f"agents did not {doing} in time", names,
                                 "no answer within the launch timeout "
                                 f"({self.opts.launch_timeout}s)",
                                 "check those hosts with `dtrain check`")
            try:
                event = self.events.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                self._check_silence(waiting, doing)
                continue
            self._expect(event, kind, doing, waiting, on_body)
            self._check_silence(waiting, doing)

    def _check_silence(self, waiting: set[int], doing: str) -> None:
        # Agents send heartbeats every 5 s until the SPEC sets the job's interval.
        limit = max(self.opts.heartbeat * self.opts.misses, 15.0)
        now = time.monotonic()
        for index in waiting:
            link = self.links[index]
            if now - link.last_heard > limit:
                raise AgentError(f"agent did not {doing}", f"host {link.name}",
                                 f"no heartbeat for {now - link.last_heard:.1f}s (host down or "
                                 "network cut?)", "nothing was started; check the host")

    def _expect(self, event: Any, kind: wire.Kind, doing: str, waiting: set[int],
                on_body: Callable[[AgentLink, dict], None]) -> None:
        if isinstance(event, Closed):
            link = self.links[event.host]
            _agent_failed(link, f"could not {doing}", event.reason)
        if not isinstance(event, Received):
            if isinstance(event, tuple) and event[0] == "signal":
                raise KeyboardInterrupt
            return
        link = self.links[event.host]
        link.last_heard = time.monotonic()
        if event.frame.kind is wire.Kind.ERROR:
            body = event.frame.json()
            raise AgentError(str(body.get("what")), f"host {link.name}", str(body.get("why")),
                             str(body.get("fix", "")))
        if event.frame.kind is kind:
            on_body(link, event.frame.json())
            waiting.discard(event.host)

    def _query(self, link: AgentLink, query: dict[str, Any]) -> dict[str, Any]:
        link.send_json(wire.Kind.QUERY, query)
        answer: dict[str, Any] = {}
        self._gather_one(link, wire.Kind.REPLY, answer)
        if "error" in answer:
            raise AgentError(f"query {query['op']} failed", f"host {link.name}", answer["error"])
        return answer

    def _gather_one(self, link: AgentLink, kind: wire.Kind, into: dict[str, Any]) -> None:
        waiting = {link.index}
        while waiting:
            if time.monotonic() > self.deadline:
                raise AgentError("agent did not answer", f"host {link.name}", "launch timeout")
            try:
                event = self.events.get(timeout=0.5)
            except queue.Empty:
                continue
            if isinstance(event, Received) and event.host != link.index:
                continue
            self._expect(event, kind, "answer", waiting, lambda _l, body: into.update(body))

    def _master_addr(self) -> str:
        """An address of rank 0's host that the other hosts can reach."""
        first = self.links[0]
        others = [link for link in self.links[1:]]
        if not others:
            return "127.0.0.1"
        dest = _address_of(others[0])
        if _is_local(first):
            return route_source(dest)
        return str(self._query(first, {"op": "route_source", "dest": dest})["address"])

    def _free_port(self) -> int:
        return int(self._query(self.links[0], {"op": "free_port"})["port"])


def _is_local(link: AgentLink) -> bool:
    return bool(getattr(link.stream, "is_local", False))


def _address_of(link: AgentLink) -> str:
    """The address the head reached this host at (the SSH peer), else its name resolved."""
    conn = getattr(link.stream, "connection", None)
    if conn is not None:
        try:
            return str(conn.transport.getpeername()[0])
        except (OSError, AttributeError, IndexError):
            pass
    return socket.getaddrinfo(link.name, None, type=socket.SOCK_STREAM)[0][4][0]


def _agent_failed(link: AgentLink, what: str, why: str) -> None:
    stderr = link.stderr_text().strip()
    if stderr:
        why += f"; agent stderr: {stderr.splitlines()[-1]}"
    raise AgentError(f"agent {what}", f"host {link.name}", why,
                     "check that dtrain is installed in the same Python on that host "
                     "(`dtrain check`)")
