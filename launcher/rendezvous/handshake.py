"""The rendezvous handshake: a shared token proves an agent and the head to each other, with
challenge and response over the connection; the token itself is never sent.

    agent -> head   AUTH   {"rendezvous": VERSION, "nonce": Na}
    head  -> agent  AUTH   {"nonce": Nh}                             (a challenge, no proof)
    agent -> head   AUTH   {"proof": MAC(token, "agent", Na, Nh)}
    head  -> agent  AUTH   {"proof": MAC(token, "head", Na, Nh)}     or REFUSE: a wrong proof
    (sealed from here: `launcher.rendezvous.channel`, keys derived from token, Na, Nh)
    agent -> head   JOIN   {"host", "node_rank", "gpus", "protocol", "dtrain"}
    head  -> agent  ADMIT  {"nnodes", "joined"}                      or REFUSE {"why", "fix"}

MAC is HMAC-SHA256. Each side proves itself over a nonce the other chose, so a recorded
exchange proves nothing later; the role names keep a proof of one side from passing as the
other's; proofs are compared in constant time. The agent proves itself first: the head is the
side anyone on the network can reach, so it answers a stranger with nothing keyed by the token
(a stranger would otherwise take a proof home and guess the token offline). Only what answers
on the head's own address sees an agent's proof, and the token's 256 random bits (`tokens`)
make guessing it from one hopeless anyway.

Nothing before the sealed ADMIT/REFUSE is authenticated, so neither side lets it decide
anything for good: the head drops a peer that fails (`listener`), the agent tries again
(`join`).

Pure: no sockets (`launcher.rendezvous.gate` and `join` carry the frames).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import Any

from launcher.rendezvous.channel import Channel

VERSION = 2              # of this handshake (2: the agent proves first); another is refused
NONCE_BYTES = 32
_LABEL = b"dtrain rendezvous 1"


class HandshakeError(Exception):
    """The peer does not speak this handshake (another program, another version)."""


class AuthError(Exception):
    """The peer's proof does not match this side's token."""


def _mac(token: bytes, role: bytes, agent_nonce: bytes, head_nonce: bytes) -> bytes:
    return hmac.new(token, b"\0".join((_LABEL, role, agent_nonce, head_nonce)),
                    hashlib.sha256).digest()


def _keys(token: bytes, agent_nonce: bytes, head_nonce: bytes) -> tuple[bytes, bytes]:
    """Session keys (head to agent, agent to head), fresh for every connection."""
    return (_mac(token, b"key head->agent", agent_nonce, head_nonce),
            _mac(token, b"key agent->head", agent_nonce, head_nonce))


def _hex(body: dict[str, Any], name: str, size: int) -> bytes:
    value = body.get(name)
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise HandshakeError(f"the {name} field is not {size} bytes of hex")
    return raw


@dataclass
class AgentSide:
    """The agent's half: `hello`, `prove` on the head's challenge, `check` the head's proof,
    then `channel`."""

    token: bytes
    nonce: bytes = b""
    head_nonce: bytes = b""

    def __post_init__(self) -> None:
        self.nonce = self.nonce or os.urandom(NONCE_BYTES)

    def hello(self) -> dict[str, Any]:
        return {"rendezvous": VERSION, "nonce": self.nonce.hex()}

    def prove(self, challenge: dict[str, Any]) -> dict[str, Any]:
        """The agent's proof over the head's nonce (HandshakeError for a malformed one)."""
        self.head_nonce = _hex(challenge, "nonce", NONCE_BYTES)
        return {"proof": _mac(self.token, b"agent", self.nonce, self.head_nonce).hex()}

    def check(self, body: dict[str, Any]) -> Channel:
        """The sealed channel to a head that proved the token; AuthError otherwise."""
        proof = _hex(body, "proof", hashlib.sha256().digest_size)
        if not hmac.compare_digest(proof, _mac(self.token, b"head", self.nonce,
                                               self.head_nonce)):
            raise AuthError("the head's proof does not match this agent's token")
        to_agent, to_head = _keys(self.token, self.nonce, self.head_nonce)
        return Channel(send_key=to_head, receive_key=to_agent)


@dataclass
class HeadSide:
    """The head's half of one connection: `challenge` the agent's hello, then `verify` its
    proof; the head proves itself only to an agent that proved the token."""

    token: bytes
    nonce: bytes = b""
    agent_nonce: bytes = b""

    def __post_init__(self) -> None:
        self.nonce = self.nonce or os.urandom(NONCE_BYTES)

    def challenge(self, hello: dict[str, Any]) -> dict[str, Any]:
        """The head's nonce; HandshakeError when the peer is not a dtrain agent of this
        handshake's version."""
        if "rendezvous" not in hello:
            raise HandshakeError("the peer did not open with a dtrain rendezvous hello")
        if hello["rendezvous"] != VERSION:
            raise HandshakeError(f"the agent speaks rendezvous {str(hello['rendezvous'])[:20]}, "
                                 f"the head {VERSION}")
        self.agent_nonce = _hex(hello, "nonce", NONCE_BYTES)
        return {"nonce": self.nonce.hex()}

    def verify(self, body: dict[str, Any]) -> tuple[dict[str, Any], Channel]:
        """The head's proof and the sealed channel, for an agent that proved the token;
        AuthError otherwise."""
        proof = _hex(body, "proof", hashlib.sha256().digest_size)
        if not hmac.compare_digest(proof, _mac(self.token, b"agent", self.agent_nonce,
                                               self.nonce)):
            raise AuthError("the agent's proof does not match the head's token")
        to_agent, to_head = _keys(self.token, self.agent_nonce, self.nonce)
        return ({"proof": _mac(self.token, b"head", self.agent_nonce, self.nonce).hex()},
                Channel(send_key=to_agent, receive_key=to_head))
