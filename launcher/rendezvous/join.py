"""`dtrain agent --rendezvous HOST:PORT --token-file F`: what the external starter runs on every
node (a pod, a batch script, an instance group) to join the head (adapter).

The agent keeps trying until the head answers (it may start first: connection refused, a name
not resolvable yet, no route yet), with back-off, until --join-timeout. Then the handshake
(`handshake`): a wrong token, or a head that refuses it (late, duplicate, excluded, another
version), ends it at once with one error and a non-zero exit, nothing started. Admitted, it is
the same agent as over SSH (`launcher.agent.serve`) over the sealed connection: it stops its
ranks and exits non-zero when the head goes away (EOF, or silence for the heartbeat budget).
"""

from __future__ import annotations

import random
import socket
import sys
import time
from typing import NoReturn

from launcher import __version__, wire
from launcher.agent.facts import gpu_count
from launcher.agent.head_link import HeadLink
from launcher.agent.serve import serve
from launcher.errors import RendezvousError
from launcher.rendezvous.handshake import AgentSide, AuthError, HandshakeError
from launcher.rendezvous.options import JoinOptions, read_token
from launcher.rendezvous.stream import SealedSocket, prepare, read_clear, send_clear

HANDSHAKE_S = 10.0      # from connected to admitted
CONNECT_S = 5.0         # one connection attempt
BACKOFF_S = (0.1, 2.0)  # first and longest pause between attempts (with jitter)
NOTE_EVERY_S = 30.0     # how often a waiting agent says what it waits for


def run_agent(opts: JoinOptions) -> NoReturn:
    """Join the head, then serve as its agent until it says BYE or goes away (never returns:
    the process exits with the agent's code)."""
    token = read_token(opts.token_file)
    sealed = join(opts, token)
    serve(lambda events: HeadLink(events, sealed.read, sealed))


def join(opts: JoinOptions, token: bytes) -> SealedSocket:
    """The admitted connection to the head; RendezvousError when refused or out of time."""
    where = f"--rendezvous {opts.host}:{opts.port}"
    facts: dict[str, object] = {
        "host": socket.gethostname(), "node_rank": opts.node_rank, "gpus": gpu_count(),
        "protocol": wire.PROTOCOL_VERSION, "dtrain": __version__}
    deadline = time.monotonic() + opts.timeout
    pause, noted = BACKOFF_S[0], 0.0
    while True:
        left = deadline - time.monotonic()
        try:
            sock = socket.create_connection((opts.host, opts.port),
                                            timeout=max(0.1, min(CONNECT_S, left)))
        except OSError as exc:
            why = exc.strerror or str(exc) or type(exc).__name__
        else:
            try:
                return _handshake(sock, token, facts, where)
            except (HandshakeError, OSError, wire.WireError) as exc:  # cut off half-way, or
                why = str(exc) or type(exc).__name__  # not a head yet: it may be restarting
            except BaseException:
                sock.close()
                raise
            sock.close()
        now = time.monotonic()
        if now >= deadline:
            raise RendezvousError("no head answered", where, f"tried for {opts.timeout:g}s; "
                                  f"the last attempt: {why}", "start the head (`dtrain launch "
                                  "--rendezvous-port PORT --nnodes N`) or correct the address, "
                                  "or raise --join-timeout")
        if now - noted >= NOTE_EVERY_S:
            noted = now
            sys.stderr.write(f"dtrain agent: waiting for the head at {opts.host}:{opts.port} "
                             f"({why}); trying for {deadline - now:.0f}s more\n")
        time.sleep(min(pause * random.uniform(0.5, 1.0), max(0.0, deadline - now)))
        pause = min(2 * pause, BACKOFF_S[1])


def _handshake(sock: socket.socket, token: bytes, facts: dict[str, object],
               where: str) -> SealedSocket:
    deadline = time.monotonic() + HANDSHAKE_S
    prepare(sock)
    agent = AgentSide(token)
    send_clear(sock, wire.Kind.AUTH, agent.hello())
    reply = read_clear(sock, deadline)
    if reply.kind is wire.Kind.REFUSE:
        _refused(reply.json(), where)
    try:
        proof = agent.answer(reply.json())
    except AuthError:
        send_clear(sock, wire.Kind.REFUSE, {"why": "the head's proof does not match the "
                                                   "agent's token"})
        raise RendezvousError("the head does not hold this agent's token", where,
                              "its proof does not match --token-file",
                              "give the head and every agent the same token file; "
                              "nothing was started") from None
    send_clear(sock, wire.Kind.AUTH, proof)
    sealed = SealedSocket(sock, agent.channel())
    sealed.send_json(wire.Kind.JOIN, facts)
    try:
        answer = sealed.frame(deadline)
    except wire.WireError:  # a REFUSE in clear does not open: the head refused the proof
        raise RendezvousError("the head refused this agent's token", where, "its proof does "
                              "not match the head's token", "give the head and every agent "
                              "the same token file; nothing was started") from None
    if answer.kind is not wire.Kind.ADMIT:
        _refused(answer.json() if answer.kind is wire.Kind.REFUSE else
                 {"why": f"{answer.kind.name} instead of ADMIT"}, where)
    sock.settimeout(None)
    return sealed


def _refused(body: dict[str, object], where: str) -> NoReturn:
    fix = str(body.get("fix") or "see the head's output")
    raise RendezvousError("the head refused this agent", where, str(body.get("why")), fix)
