"""`dtrain agent --rendezvous HOST:PORT --token-file F`: what the external starter runs on every
node (a pod, a batch script, an instance group) to join the head (adapter).

The agent keeps trying until a head admits it (the head may start first: connection refused, a
name not resolvable yet, no route yet), with back-off, until --join-timeout. Then the handshake
(`handshake`): the agent proves the token, the head proves it back. Whatever answers on the
head's address before its proof is believed for nothing: a refusal in clear (a wrong token,
another version), a wrong head proof, a malformed frame or a channel that does not open is
printed (network text escaped) and tried again until the deadline, so a stranger cannot end
the agents of a job. Only a refusal over the sealed channel (late, duplicate, excluded, another
protocol) comes from the head that holds the token and ends the agent at once, non-zero,
nothing started. Admitted, it is the same agent as over SSH (`launcher.agent.serve`) over the
sealed connection: it stops its ranks and exits non-zero when the head goes away (EOF, or
silence for the heartbeat budget).
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
from launcher.rendezvous import clear
from launcher.rendezvous.handshake import AgentSide, AuthError, HandshakeError
from launcher.rendezvous.options import JoinOptions, read_token
from launcher.rendezvous.stream import SealedSocket, prepare, read_clear, send_clear
from launcher.rendezvous.tokens import MAKE_ONE

HANDSHAKE_S = 10.0      # from connected to admitted
CONNECT_S = 5.0         # one connection attempt
BACKOFF_S = (0.1, 2.0)  # first and longest pause between attempts (with jitter)
NOTE_EVERY_S = 30.0     # how often a waiting agent says what it waits for


class _TokenRefused(HandshakeError):
    """What answered on the head's address refused this agent's proof (in clear: unproved)."""


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
    pause, noted, token_refused = BACKOFF_S[0], float("-inf"), False
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
            except (HandshakeError, OSError, wire.WireError) as exc:  # cut off half-way, not
                why = str(exc) or type(exc).__name__  # a head yet, or nothing that proved it
                token_refused = token_refused or isinstance(exc, _TokenRefused)
            except BaseException:
                sock.close()
                raise
            sock.close()
        now = time.monotonic()
        if now >= deadline and token_refused:
            raise RendezvousError("the head did not accept this agent's token", where,
                                  f"tried for {opts.timeout:g}s; the last attempt: {why}",
                                  "give the head and every agent the same token file "
                                  f"({MAKE_ONE}); nothing was started")
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
    challenge = _expect(read_clear(sock, deadline), "the head's challenge")
    send_clear(sock, wire.Kind.AUTH, agent.prove(clear.body(challenge)))
    reply = read_clear(sock, deadline)
    if reply.kind is wire.Kind.REFUSE:
        raise _TokenRefused(f"refused in clear (unproved): {_said(reply)}")
    try:
        channel = agent.check(clear.body(_expect(reply, "the head's proof")))
    except AuthError:
        raise HandshakeError("what answered does not hold this agent's token: its proof does "
                             "not match") from None
    sealed = SealedSocket(sock, channel)
    sealed.send_json(wire.Kind.JOIN, facts)
    answer = sealed.frame(deadline)
    if answer.kind is wire.Kind.REFUSE:  # sealed: the head that holds the token said so
        body = clear.body(answer)
        raise RendezvousError("the head refused this agent", where, clear.shown(body.get("why")),
                              clear.shown(body.get("fix") or "see the head's output"))
    _expect(answer, "ADMIT", wire.Kind.ADMIT)
    sock.settimeout(None)
    return sealed


def _expect(frame: wire.Frame, what: str, kind: wire.Kind = wire.Kind.AUTH) -> wire.Frame:
    """``frame`` when it is of ``kind``; else HandshakeError (an unproved REFUSE says why)."""
    if frame.kind is kind:
        return frame
    if frame.kind is wire.Kind.REFUSE:
        raise HandshakeError(f"refused in clear (unproved): {_said(frame)}")
    raise HandshakeError(f"a {frame.kind.name} frame instead of {what}")


def _said(refusal: wire.Frame) -> str:
    """An unproved REFUSE's text, escaped, for the agent's own lines."""
    try:
        body = clear.body(refusal)
    except HandshakeError as exc:
        return str(exc)
    return clear.shown(" ".join(str(body.get(k) or "") for k in ("why", "fix")).strip())
