"""Frames exchanged between the head and a per-host agent over one byte stream.

The stream is the agent's stdin/stdout: an SSH channel for a remote host, a pipe for localhost.
A frame is ``length (u32, big-endian) | kind (u8) | payload``, where ``length`` counts the kind
byte and the payload. Control frames carry UTF-8 JSON objects; OUTPUT carries raw bytes so the
ranks' output is relayed unchanged (progress bars, partial lines, non-UTF-8 all survive).

Everything here is pure: no sockets, no threads.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from typing import Any

PROTOCOL_VERSION = 4  # 2: STDIN and STDIN_ACK frames; 3: PROGRESS and PROBE; 4: rounds (a
#                     SPEC after DONE starts the next round; a SPEC without ranks checks a spare)
MAX_FRAME = 16 * 1024 * 1024
_HEADER = struct.Struct("!IB")
_OUTPUT_HEADER = struct.Struct("!IB")


class Kind(enum.IntEnum):
    HELLO = 1       # agent -> head: versions, host facts
    SPEC = 2        # head -> agent: the ranks to start (argv, env, cwd)
    STARTED = 3     # agent -> head: {"rank", "pid"}
    OUTPUT = 4      # agent -> head: rank (u32), stream (u8), raw bytes
    EXIT = 5        # agent -> head: {"rank", "code", "signal"}
    KILL = 6        # head -> agent: {"signal", "grace"}: stop every rank of the job
    HEARTBEAT = 7   # both ways, empty
    PMI = 8         # both ways: PMI relay messages (see launcher.pmi)
    QUERY = 9       # head -> agent: {"op", ...} small questions (route source address)
    REPLY = 10      # agent -> head: answer to QUERY
    ERROR = 11      # agent -> head: {"what", "why"}: the agent cannot go on
    DONE = 12       # agent -> head: every rank has exited, the agent is leaving
    BYE = 13        # head -> agent: leave now (after KILL or when the job is over)
    READY = 14      # agent -> head: the SPEC was checked (cwd, program) and can start
    START = 15      # head -> agent: start the ranks (sent once every host is READY)
    STDIN = 16      # head -> agent: raw bytes for rank 0's stdin; empty payload = EOF
    STDIN_ACK = 17  # agent -> head: {"bytes"}: written into rank 0's stdin (flow credit)
    PROGRESS = 18   # agent -> head: {"ranks": [RankView...], "stacks"?, "probe"?, "final"?}
    PROBE = 19      # head -> agent: {"probe", "stacks": [ranks]}: records now, with stacks


class WireError(ValueError):
    """The byte stream does not hold well-formed frames."""


@dataclass(frozen=True)
class Frame:
    kind: Kind
    payload: bytes

    def json(self) -> dict[str, Any]:
        try:
            value = json.loads(self.payload.decode("utf-8")) if self.payload else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise WireError(f"{self.kind.name} frame is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise WireError(f"{self.kind.name} frame is not a JSON object")
        return value


@dataclass(frozen=True)
class Output:
    rank: int
    stream: int  # 1 = stdout, 2 = stderr
    data: bytes


def encode(kind: Kind, payload: bytes = b"") -> bytes:
    if len(payload) + 1 > MAX_FRAME:
        raise WireError(f"{kind.name} frame of {len(payload)} bytes exceeds {MAX_FRAME}")
    return _HEADER.pack(len(payload) + 1, int(kind)) + payload


def encode_json(kind: Kind, obj: dict[str, Any] | None = None) -> bytes:
    body = b"" if obj is None else json.dumps(obj, separators=(",", ":")).encode("utf-8")
    return encode(kind, body)


def encode_output(rank: int, stream: int, data: bytes) -> bytes:
    return encode(Kind.OUTPUT, _OUTPUT_HEADER.pack(rank, stream) + data)


def decode_output(frame: Frame) -> Output:
    if len(frame.payload) < _OUTPUT_HEADER.size:
        raise WireError("OUTPUT frame shorter than its header")
    rank, stream = _OUTPUT_HEADER.unpack_from(frame.payload)
    return Output(rank, stream, frame.payload[_OUTPUT_HEADER.size:])


class Decoder:
    """Incremental decoder: feed it whatever the stream gave, get back the whole frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        self._buf += data
        frames: list[Frame] = []
        while len(self._buf) >= _HEADER.size:
            length, kind = _HEADER.unpack_from(self._buf)
            if length < 1 or length > MAX_FRAME:
                raise WireError(f"frame length {length} out of range")
            if len(self._buf) < 4 + length:
                break
            try:
                k = Kind(kind)
            except ValueError:
                raise WireError(f"unknown frame kind {kind}") from None
            frames.append(Frame(k, bytes(self._buf[5:4 + length])))
            del self._buf[:4 + length]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame still waiting for the rest."""
        return len(self._buf)
