"""The handshake's frames in clear, from whoever reached the port: bounded in size and nesting
before anything parses them, and their text made safe to print (pure).

A handshake frame holds a flat JSON object of nonces, proofs and short strings. Anything
bigger than FRAME_MAX, or nested deeper than DEPTH_MAX, is not our peer: it is refused before
`json` sees it (a few KB of ``[[[[`` would otherwise exhaust the parser's recursion).
"""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Any

from launcher import wire
from launcher.rendezvous.handshake import HandshakeError

FRAME_MAX = 4096   # bytes of a frame in clear (and of the sealed JOIN/ADMIT); nonces are 64
DEPTH_MAX = 4      # nesting of arrays and objects; the handshake's own frames have 1
TEXT_MAX = 300     # characters of network text shown in a line
_HEADER = 5        # length (u32) and kind (u8)
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def split(buffer: bytes | bytearray) -> tuple[wire.Frame | None, int]:
    """The first whole frame in ``buffer`` and the bytes it took, (None, 0) while it is still
    partial; HandshakeError for a frame too big or of no known kind."""
    if len(buffer) < _HEADER:
        return None, 0
    length = int.from_bytes(buffer[:4], "big")
    if not 1 <= length <= FRAME_MAX:
        raise HandshakeError(f"a {length}-byte frame is not a rendezvous handshake")
    if len(buffer) < 4 + length:
        return None, 0
    try:
        kind = wire.Kind(buffer[4])
    except ValueError:
        raise HandshakeError(f"unknown frame kind {buffer[4]}") from None
    return wire.Frame(kind, bytes(buffer[_HEADER:4 + length])), 4 + length


def body(frame: wire.Frame) -> dict[str, Any]:
    """The frame's JSON object, its nesting checked first; HandshakeError when it is none."""
    depth = _depth(frame.payload)
    if depth > DEPTH_MAX:
        raise HandshakeError(f"{frame.kind.name} frame nests {depth} levels deep (at most "
                             f"{DEPTH_MAX})")
    try:
        value = json.loads(frame.payload.decode("utf-8")) if frame.payload else {}
    except (UnicodeDecodeError, ValueError) as exc:
        raise HandshakeError(f"{frame.kind.name} frame is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise HandshakeError(f"{frame.kind.name} frame is not a JSON object")
    return value


def _depth(payload: bytes) -> int:
    """The deepest nesting of brackets outside strings, counted without recursion (stops
    counting past DEPTH_MAX + 1: the frame is refused either way)."""
    level = deepest = 0
    for byte in _STRING.sub(b'""', payload):
        if byte in b"[{":
            level += 1
            deepest = max(deepest, level)
            if deepest > DEPTH_MAX:
                break
        elif byte in b"]}":
            level -= 1
    return deepest


def shown(value: object) -> str:
    """Text from the network as one printable line: control and format characters (escape
    sequences, carriage returns, bidirectional overrides) as escapes, at most TEXT_MAX
    characters."""
    text = str(value)
    cut = len(text) > TEXT_MAX
    out = "".join(ch if unicodedata.category(ch)[0] != "C" else
                  ascii(ch)[1:-1] for ch in text[:TEXT_MAX])
    return out + ("..." if cut else "")
