"""Frames exchanged between the head and a per-host agent over one byte stream, and the SPEC.

The stream is the agent's stdin/stdout: an SSH channel for a remote host, a pipe for localhost.
A frame is ``length (u32, big-endian) | kind (u8) | payload``, where ``length`` counts the kind
byte and the payload. Control frames carry UTF-8 JSON objects; OUTPUT carries raw bytes so the
ranks' output is relayed unchanged (progress bars, partial lines, non-UTF-8 all survive).
A JSON object of `COMPRESS_FROM` bytes or more travels zlib-compressed (its first byte is then
``x``, never ``{``): a fence's business cards, pushed to every host, are hex text that
compresses 4-5x (MPICH's, 64 hosts: 290 KB a host), and through SSH every byte costs the head's
CPU (paramiko encrypts in Python's thread), each host's sshd and its agent, on cores the
ranks wiring up share (`bench.hosts_scale`).

The SPEC (what one host runs) is typed: `AgentSpec` with its `RankStart` and `PmiSpec` parts,
built by the head and read by the agent, and `Watch`, the liveness settings both sides use.
Their defaults are the only ones: the head's options and the command line read them from here.

Everything here is pure: no sockets, no threads.
"""

from __future__ import annotations

import enum
import json
import struct

from records import Record, asdict, field

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar

    T = TypeVar("T")

PROTOCOL_VERSION = 8  # 2: STDIN and STDIN_ACK frames; 3: PROGRESS and PROBE; 4: rounds (a
#                     SPEC after DONE starts the next round; a SPEC without ranks checks a spare);
#                     5: the ranks' forwarded environment comes with START, not in the SPEC;
#                     6: fan-out (SUBTREE, ROUTED, GONE; a fence of many hosts in one message)
#                     7: large JSON objects compressed (COMPRESS_FROM)
#                     8: a fetch's answer names no request (the same frame for every host)
MAX_FRAME = 16 * 1024 * 1024
#: A JSON object this long or longer is sent compressed (zlib's fastest level: ~2 ms for a
#: 290 KB fence once at the head, well under a millisecond to inflate at each host).
COMPRESS_FROM = 64 * 1024
#: The most a compressed JSON object may inflate to (a frame is refused beyond it).
MAX_JSON = 4 * MAX_FRAME
_HEADER = struct.Struct("!IB")
_OUTPUT_HEADER = struct.Struct("!IB")
_INDEX = struct.Struct("!I")
_ROUTED_HEADERS = struct.Struct("!IBI")  # _HEADER, then _INDEX
_OUTPUT_HEADERS = struct.Struct("!IBIB")  # _HEADER, then _OUTPUT_HEADER
#: The first byte of a compressed JSON payload: zlib's header at every level (32 KiB window).
COMPRESSED = b"x"


class Kind(enum.IntEnum):
    HELLO = 1       # agent -> head: versions, host facts
    SPEC = 2        # head -> agent: the ranks to start (argv, env, cwd)
    STARTED = 3     # agent -> head: {"rank", "pid"}
    OUTPUT = 4      # agent -> head: rank (u32), stream (u8), raw bytes
    EXIT = 5        # agent -> head: {"rank", "code", "signal", "sent", "error"?}: "sent" is
    #                 every signal the agent sent the rank, [[signum, seconds after the first],
    #                 ...]; "error": what its error file says (errorfile.RootCause)
    KILL = 6        # head -> agent: {"signal", "grace"}: stop every rank of the job
    HEARTBEAT = 7   # both ways, empty
    PMI = 8         # both ways: PMI relay messages (see launcher.pmi)
    QUERY = 9       # head -> agent: {"op", ...} small questions (route source address)
    REPLY = 10      # agent -> head: answer to QUERY
    ERROR = 11      # agent -> head: {"what", "why"}: the agent cannot go on
    DONE = 12       # agent -> head: every rank has exited, the agent is leaving
    BYE = 13        # head -> agent: leave now (after KILL or when the job is over)
    READY = 14      # agent -> head: the SPEC was checked (cwd, program) and can start
    START = 15      # head -> agent: {"env", "base"}: start the ranks (once every host is
    #                 READY) with MASTER_* (env) and the forwarded variables (base)
    STDIN = 16      # head -> agent: raw bytes for rank 0's stdin; empty payload = EOF
    STDIN_ACK = 17  # agent -> head: {"bytes"}: written into rank 0's stdin (flow credit)
    PROGRESS = 18   # agent -> head: {"ranks": [RankView...], "stacks"?, "probe"?, "final"?}
    PROBE = 19      # head -> agent: {"probe", "stacks": [ranks]}: records now, with stacks
    # A rendezvous connection's handshake (launcher.rendezvous), before the frames above:
    AUTH = 20       # both ways: nonces and proofs of the shared token (never the token)
    JOIN = 21       # agent -> head: who joins (host name, node rank, GPUs, versions)
    ADMIT = 22      # head -> agent: accepted; the SPEC follows once every agent is here
    REFUSE = 23     # both ways: {"why", "fix"}: refused; this agent starts nothing
    # Fan-out through the hosts (launcher.tree): a relay agent starts its subtree's agents.
    SUBTREE = 24    # head -> relay, first frame: the hosts it starts and how (launcher.tree.hops)
    ROUTED = 25     # both ways: host index (u32) + whole frames of that host's stream
    GONE = 26       # relay -> head: {"host", "why", "connect"?}: that host's stream ended


class WireError(ValueError):
    """The byte stream does not hold well-formed frames."""


class Frame(Record, frozen=True):
    kind: Kind
    payload: bytes

    def json(self) -> dict[str, Any]:
        return decode_json(self.kind, self.payload)


def decode_json(kind: Kind, payload: bytes | memoryview) -> dict[str, Any]:
    """The JSON object of a ``kind`` frame's payload: its own bytes, or a view of them in the
    whole frame as it came (a relay reads a child's PMI message so, without copying it out)."""
    if payload[:1] == COMPRESSED:
        payload = _inflate(kind, payload)
    try:
        value = json.loads(str(payload, "utf-8")) if payload else {}
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
        raise WireError(f"{kind.name} frame is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise WireError(f"{kind.name} frame is not a JSON object")
    return value


class Output(Record, frozen=True):
    rank: int
    stream: int  # 1 = stdout, 2 = stderr
    data: bytes


def encode(kind: Kind, payload: bytes = b"") -> bytes:
    return _HEADER.pack(_length(kind, len(payload)), int(kind)) + payload


def _length(kind: Kind, payload: int) -> int:
    """The length field of a ``kind`` frame with ``payload`` bytes (refused beyond MAX_FRAME)."""
    if payload + 1 > MAX_FRAME:
        raise WireError(f"{kind.name} frame of {payload} bytes exceeds {MAX_FRAME}")
    return payload + 1


def encode_json(kind: Kind, obj: dict[str, Any] | None = None) -> bytes:
    body = b"" if obj is None else json.dumps(obj, separators=(",", ":")).encode("utf-8")
    return encode(kind, _deflate(body))


def _deflate(body: bytes) -> bytes:
    if len(body) < COMPRESS_FROM:
        return body
    import zlib  # only here: most agents never send or read an object this large

    return zlib.compress(body, 1)  # its header's first byte is COMPRESSED


def _inflate(kind: Kind, payload: bytes | memoryview) -> bytes:
    import zlib

    inflater = zlib.decompressobj()
    try:
        body = inflater.decompress(payload, MAX_JSON)
    except zlib.error as exc:
        raise WireError(f"{kind.name} frame is not valid compressed JSON: {exc}") from None
    if inflater.unconsumed_tail:
        raise WireError(f"{kind.name} frame inflates beyond {MAX_JSON} bytes")
    if not inflater.eof:
        raise WireError(f"{kind.name} frame's compressed JSON is cut short")
    return body


def encode_value(value: Any) -> bytes:
    """``value`` as JSON, for `encode_json_shared`."""
    return json.dumps(value, separators=(",", ":")).encode("utf-8")


def encode_json_shared(kind: Kind, obj: dict[str, Any], key: str, encoded: bytes) -> bytes:
    """`encode_json` of ``obj`` whose ``obj[key]`` is already encoded (`encode_value`): a
    large value shared by many messages (a fence's cards, sent to every relay with its own
    host list) is encoded once, not once per message."""
    rest = encode_value({k: v for k, v in obj.items() if k != key})[:-1]
    return encode(kind, _deflate(b"".join((rest, b"," if len(rest) > 1 else b"",
                                           encode_value(key), b":", encoded, b"}"))))


def opens(payload: bytes | memoryview, opening: bytes) -> bool:
    """A JSON frame's ``payload`` begins with ``opening`` (a relay picks a fetch's answer out of
    what passes down so), read from its first bytes, inflated when compressed, the rest left."""
    head = payload[:len(opening)]
    if head[:1] == COMPRESSED:
        import zlib

        try:  # a dynamic block's code tables come first: well under 4 KiB of input
            head = zlib.decompressobj().decompress(payload[:4096], len(opening))
        except zlib.error:
            return False
    return head == opening


def encode_output(rank: int, stream: int, data: bytes) -> bytes:
    """Rank output as an OUTPUT frame, its two headers packed together (as `encode_routed`)."""
    length = _length(Kind.OUTPUT, _OUTPUT_HEADER.size + len(data))
    return _OUTPUT_HEADERS.pack(length, Kind.OUTPUT, rank, stream) + data


def encode_routed(host: int, frames: bytes) -> bytes:
    """Whole frames of host ``host``'s stream, carried by the relays between it and the head
    (the header and index packed together: the frames are copied once, not twice)."""
    length = _length(Kind.ROUTED, _INDEX.size + len(frames))
    return _ROUTED_HEADERS.pack(length, Kind.ROUTED, host) + frames


def decode_routed(frame: Frame) -> tuple[int, bytes]:
    """(host index, the whole frames of its stream) of a ROUTED frame."""
    if len(frame.payload) < _INDEX.size:
        raise WireError("ROUTED frame shorter than its header")
    return _INDEX.unpack_from(frame.payload)[0], frame.payload[_INDEX.size:]


def decode_output(frame: Frame) -> Output:
    if len(frame.payload) < _OUTPUT_HEADER.size:
        raise WireError("OUTPUT frame shorter than its header")
    rank, stream = _OUTPUT_HEADER.unpack_from(frame.payload)
    return Output(rank, stream, frame.payload[_OUTPUT_HEADER.size:])


def split(data: bytes) -> list[bytes]:
    """The whole frames in ``data`` (a ROUTED frame's), each as it came: a relay forwards one
    unchanged (``data`` itself when it is the one frame: no copy of a large one)."""
    frames, at = [], 0
    while at + _HEADER.size <= len(data):
        length = _HEADER.unpack_from(data, at)[0]
        end = at + 4 + length
        if length < 1 or end > len(data):  # not whole frames: the rest is left
            break
        frames.append(data[at:end])
        at = end
    return frames


_KINDS = {int(kind): kind for kind in Kind}


class Decoder:
    """Incremental decoder: feed it whatever the stream gave, get back the whole frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        return self._whole(data, lambda kind, frame: Frame(kind, bytes(frame[5:])))

    def feed_raw(self, data: bytes) -> list[bytes]:
        """The whole frames, each as the bytes that came (checked as `feed` checks them; the
        kind is byte 4): a relay forwards them without decoding and encoding them again."""
        return self._whole(data, lambda kind, frame: bytes(frame))

    def _whole(self, data: bytes, take: Callable[[Kind, memoryview], T]) -> list[T]:
        """``take(kind, the frame's bytes in the buffer)`` of each whole frame, in order."""
        self._buf += data
        frames: list[T] = []
        while len(self._buf) >= _HEADER.size:
            length, kind = _HEADER.unpack_from(self._buf)
            if length < 1 or length > MAX_FRAME:
                raise WireError(f"frame length {length} out of range")
            if len(self._buf) < 4 + length:
                break
            if (k := _KINDS.get(kind)) is None:  # not `Kind(kind)`: 0.43 µs a frame, not 0.03
                raise WireError(f"unknown frame kind {kind}")
            with memoryview(self._buf) as view:  # one copy out of the buffer, not two
                frames.append(take(k, view[:4 + length]))
            del self._buf[:4 + length]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame still waiting for the rest."""
        return len(self._buf)


# -- the SPEC ---------------------------------------------------------------------------------
class Watch(Record, frozen=True):
    """How the head and an agent watch each other (the agent uses these before any SPEC)."""

    heartbeat: float = 5.0   # seconds between heartbeats, both directions
    misses: int = 3          # silent intervals before the other side counts as gone
    grace: float = 10.0      # seconds from SIGTERM to SIGKILL when ranks are stopped

    @property
    def limit(self) -> float:
        """How long the other side may stay silent before it counts as gone."""
        return self.heartbeat * self.misses


class PmiSpec(Record, frozen=True):
    """The PMI-1 server an agent runs for its ranks (docs/design.md §3)."""

    mode: str = "fd"             # fd (PMI_FD), port (PMI_PORT + PMI_ID) or off
    kvsname: str = ""            # the job's key-value space (the job id)
    world_size: int = 0          # ranks in the whole job
    process_mapping: str = ""    # PMI_process_mapping: the ranks per host, MPICH's layout
    stall: float = 30.0          # seconds before a waiting barrier names the missing ranks


class RankStart(Record, frozen=True):
    """One rank of the host: its global rank and the variables the head planned for it."""

    rank: int
    env: dict[str, str]          # its contract variables (START adds the forwarded ones and
    #                              MASTER_*: nothing else reaches a host before it starts ranks)


class Probe(Record, frozen=True):
    """What rank 0's host is asked to find out and answer in its READY."""

    route_to: str | None = None  # its source address towards this address is MASTER_ADDR
    free_port: bool = False      # pick a free port for MASTER_PORT


class AgentSpec(Record, frozen=True):
    """The SPEC frame: everything one host's agent needs to check and start its ranks."""

    job_id: str
    argv: tuple[str, ...]        # the program and its arguments, the same on every rank
    cwd: str                     # the ranks' working directory (checked before READY)
    ranks: tuple[RankStart, ...]
    watch: Watch = Watch()
    pmi: PmiSpec = PmiSpec()
    progress_interval: float | None = None  # seconds between progress samples; None: off
    probe: Probe | None = None   # rank 0's host only
    rounds: bool = False         # stay after the ranks exit: another round may follow
    check_env: dict[str, str] = field(default_factory=dict)  # the variables that decide
    #  which program argv[0] runs (PATH, VIRTUAL_ENV...: `environment.program_env`): the check

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "job_id": self.job_id, "argv": list(self.argv), "cwd": self.cwd,
            "ranks": [{"rank": r.rank, "env": r.env} for r in self.ranks],
            "heartbeat": self.watch.heartbeat, "misses": self.watch.misses,
            "grace": self.watch.grace, "pmi": asdict(self.pmi),
        }
        if self.rounds:
            body["rounds"] = True
        if self.check_env:
            body["check_env"] = self.check_env
        if self.progress_interval is not None:
            body["progress"] = {"interval": self.progress_interval}
        if self.probe is not None:
            body["probe"] = asdict(self.probe)
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> AgentSpec:
        """The SPEC a head sent; WireError names the first field that is missing or wrong."""
        try:
            if not _typed(body["argv"], list, "argv"):
                raise ValueError("argv is empty")
            ranks = tuple(RankStart(_typed(r["rank"], int, "rank"),
                                    {str(k): str(v) for k, v in _typed(r["env"], dict,
                                                                        "env").items()})
                          for r in _typed(body["ranks"], list, "ranks"))
            progress = body.get("progress")
            return cls(
                job_id=_typed(body["job_id"], str, "job_id"),
                argv=tuple(str(a) for a in _typed(body["argv"], list, "argv")),
                cwd=_typed(body["cwd"], str, "cwd"), ranks=ranks,
                watch=Watch(float(body.get("heartbeat", Watch.heartbeat)),
                            int(body.get("misses", Watch.misses)),
                            float(body.get("grace", Watch.grace))),
                pmi=PmiSpec(**_typed(body.get("pmi") or {}, dict, "pmi")),
                progress_interval=None if progress is None else float(progress["interval"]),
                probe=None if body.get("probe") is None else Probe(**body["probe"]),
                rounds=bool(body.get("rounds", False)),
                check_env={str(k): str(v) for k, v in _typed(body.get("check_env") or {}, dict,
                                                               "check_env").items()})
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"SPEC frame is malformed: {type(exc).__name__} {exc}") from None


def _typed(value: Any, kind: type, name: str) -> Any:
    if not isinstance(value, kind):
        raise TypeError(f"{name} is {type(value).__name__}, not {kind.__name__}")
    return value
