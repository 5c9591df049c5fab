"""The per-host PMI-1 proxy core: serves the ranks of one host, relays to the head.

Pure: the agent's adapter owns the sockets, calls ``open``/``feed``/``closed`` with what they
did, ``upstream`` with what the head sent, and carries out the returned actions in order.
Like Hydra's ``pmi_proxy`` it answers everything it can locally (init, maxes, job attributes,
puts, gets of keys it has cached) and talks to the head only to combine barriers, one message
per host per barrier carrying every put of this host since the previous barrier, which keeps
the head at O(hosts) messages instead of O(ranks).

Upstream protocol (JSON-able dicts; the head side is ``launcher.pmi.kvs``):

    -> {"op": "barrier_in", "puts": {key: value}}     every local rank entered the barrier
    <- {"op": "barrier_out", "kv": {key: value}}      all puts of all hosts in that epoch
    -> {"op": "get", "key": k, "req": n}              a key this host has not seen
    <- {"op": "get_result", "req": n, "found": bool, "value": str}
    -> {"op": "abort", "rank": r, "code": n, "message": s}

Failure rules (Hydra's): a rank whose connection closes after it spoke PMI but before
``finalize`` has failed; a connection that never sent a byte (a non-MPI program) has not.
A line that is not PMI, a request out of order or a second request while one is pending closes
that connection; a connection that is not (yet) some rank's - a wrong ``PMI_ID``, a rank
claimed twice - is closed without touching anything else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from launcher.errors import PmiError
from launcher.pmi.codec import (
    LineBuffer,
    PmiCommand,
    PmiProtocolError,
    SpawnBlock,
    format_reply,
    parse_line,
)

KVSNAME_MAX, KEYLEN_MAX, VALLEN_MAX = 256, 64, 1024
_UNSUPPORTED = {  # request -> (reply, what to tell the user); no MPI_Comm_spawn, no name service
    "spawn": ("spawn_result", "MPI_Comm_spawn"),
    "publish_name": ("publish_result", "MPI_Publish_name"),
    "unpublish_name": ("unpublish_result", "MPI_Unpublish_name"),
    "lookup_name": ("lookup_result", "MPI_Lookup_name"),
}


@dataclass(frozen=True)
class Reply:
    conn: int
    data: bytes


@dataclass(frozen=True)
class Close:
    conn: int
    reason: str


@dataclass(frozen=True)
class Send:
    msg: dict


@dataclass(frozen=True)
class RankFailed:
    rank: int
    reason: str


@dataclass(frozen=True)
class Abort:
    rank: int
    code: int
    message: str


Action = Reply | Close | Send | RankFailed | Abort


@dataclass
class _Conn:
    rank: int | None
    lines: LineBuffer = field(default_factory=LineBuffer)
    started: bool = False       # spoke PMI (so closing before finalize is a failure)
    initialized: bool = False
    finalized: bool = False
    aborted: bool = False
    pending: str | None = None  # the request whose answer comes from the head
    spawn: SpawnBlock | None = None  # while swallowing an mcmd=spawn block


class PmiProxy:
    """PMI-1 server for the ranks of one host; see the module docstring.

    ``id_tokens`` maps each PMI_ID handed to a rank (PMI_PORT mode) to that rank; each works
    once. MPICH reads PMI_ID with ``atoi`` and sends it back with ``%d``, so ids must be
    positive decimal numbers below 2**31 without leading zeros (a random one per rank keeps a
    local process from guessing another rank's id).
    """

    def __init__(self, *, ranks: Sequence[int], world_size: int, kvsname: str,
                 process_mapping: str, appnum: int = 0,
                 id_tokens: Mapping[str, int] | None = None) -> None:
        self._ranks = frozenset(ranks)
        self._world, self._kvsname = world_size, kvsname
        # PMI_ keys are job attributes served here; "" means absent. Like Hydra, a mapping too
        # long for one value is left out: MPICH then exchanges host names instead.
        if len(process_mapping) > VALLEN_MAX:
            process_mapping = ""
        self._attrs = {"PMI_process_mapping": process_mapping, "universeSize": str(world_size)}
        self._tokens = dict(id_tokens or {})
        self._conns: dict[int, _Conn] = {}
        self._owner: dict[int, int] = {}            # rank -> its connection
        self._claimed: set[int] = set()             # ranks ever bound (a rank connects once)
        self._cache: dict[str, str] = {}
        self._epoch_puts: dict[str, str] = {}
        self._barrier: set[int] = set()
        self._gets: dict[int, tuple[int, str]] = {}  # req -> (conn, key)
        self._next_req = 0
        self._epoch = 0
        self._fixed = {  # requests whose answer never changes during the job
            "get_maxes": format_reply("maxes", rc=0, kvsname_max=KVSNAME_MAX,
                                      keylen_max=KEYLEN_MAX, vallen_max=VALLEN_MAX),
            "get_appnum": format_reply("appnum", rc=0, appnum=appnum),
            "get_my_kvsname": format_reply("my_kvsname", rc=0, kvsname=kvsname),
            "get_universe_size": format_reply("universe_size", rc=0, size=world_size),
        }
        self._handlers: dict[str, Callable[[int, _Conn, PmiCommand], list[Action]]] = {
            "init": self._init, "put": self._put, "get": self._get,
            "barrier_in": self._barrier_in, "finalize": self._finalize, "abort": self._abort,
        }
        self._handlers.update(dict.fromkeys(self._fixed, self._fixed_reply))

    # ----- adapter entry points -------------------------------------------------------------

    def open(self, conn: int, rank: int | None) -> list[Action]:
        """A new connection: ``rank`` is known in PMI_FD mode, None in PMI_PORT mode."""
        if conn in self._conns:
            raise ValueError(f"connection id {conn} is already open")
        if rank is not None and rank not in self._ranks:
            return [Close(conn, f"rank {rank} does not run on this host")]
        if rank is not None and rank in self._claimed:
            return [Close(conn, f"rank {rank} already has a PMI connection")]
        self._conns[conn] = _Conn(rank=None)
        if rank is not None:
            self._bind(conn, rank)
        return []

    def feed(self, conn: int, data: bytes) -> list[Action]:
        """Raw bytes read from ``conn``."""
        c = self._conns.get(conn)
        if c is None:
            return []
        c.started = c.started or (c.rank is not None and bool(data))
        error = None
        try:
            lines = c.lines.feed(data)
        except PmiProtocolError as exc:
            lines, error = list(exc.lines), exc
        actions: list[Action] = []
        for line in lines:
            actions += self._line(conn, c, line)
            if conn not in self._conns:
                return actions
        if error is not None:
            actions += self._reject(conn, error.why)
        return actions

    def closed(self, conn: int) -> list[Action]:
        """``conn`` reached EOF (or broke)."""
        c = self._conns.pop(conn, None)
        if c is None or c.rank is None or self._owner.get(c.rank) != conn:
            return []
        del self._owner[c.rank]
        if c.started and not (c.finalized or c.aborted):
            return [RankFailed(c.rank, "closed its PMI connection before finalize")]
        return []

    def upstream(self, msg: Mapping) -> list[Action]:
        """A message from the head."""
        op = msg.get("op")
        if op == "barrier_out":
            return self._barrier_out(msg.get("kv"))
        if op == "get_result":
            return self._get_result(msg)
        raise _relay_error(f"unknown op {op!r}")

    def waiting(self) -> dict:
        """Who holds things up, for a diagnosis when the job hangs."""
        barrier = sorted(self._barrier)
        return {
            "epoch": self._epoch,
            "in_barrier": barrier,
            "not_in_barrier": sorted(self._ranks - self._barrier) if barrier else [],
            "gets": {self._conns[c].rank: key for c, key in self._gets.values()
                     if c in self._conns},
            "never_connected": sorted(self._ranks - self._claimed),
            "finalized": sorted(c.rank for c in self._conns.values() if c.finalized),
        }

    # ----- one line ----------------------------------------------------------------------------

    def _line(self, conn: int, c: _Conn, line: bytes) -> list[Action]:
        if c.aborted:
            return []  # MPICH may still send barrier_in on its way out; the job is going down
        try:
            if c.spawn is not None:
                return self._spawn_line(conn, c, line)
            cmd = parse_line(line)
        except PmiProtocolError as exc:
            return self._reject(conn, exc.why)
        problem = self._order_problem(c, cmd)
        if problem:
            return self._reject(conn, problem)
        if c.rank is None:
            return self._initack(conn, c, cmd)
        if cmd.multiline:
            c.spawn = SpawnBlock()
            return []
        if cmd.cmd in _UNSUPPORTED:
            return [self._refuse(conn, cmd.cmd)]
        return self._handlers[cmd.cmd](conn, c, cmd)

    def _order_problem(self, c: _Conn, cmd: PmiCommand) -> str:
        name = cmd.cmd
        if c.rank is None:
            return "" if name == "initack" else f"sent {name} before initack (PMI_PORT mode)"
        if c.finalized:
            return f"sent {name} after finalize"
        if name == "abort":
            return ""  # accepted even before init or with a request pending
        if c.pending:
            return f"sent {name} while its {c.pending} was pending (one request at a time)"
        if name == "initack":
            return "sent initack on a connection that already has a rank"
        if cmd.multiline and name != "spawn":
            return f"unknown multi-line command mcmd={name}"
        if name not in self._handlers and name not in _UNSUPPORTED:
            return f"unknown command {name}"
        if not c.initialized and name != "init":
            return f"sent {name} before init"
        if c.initialized and name == "init":
            return "sent init twice"
        return ""

    def _reject(self, conn: int, why: str) -> list[Action]:
        c = self._conns.pop(conn)
        actions: list[Action] = [Close(conn, why)]
        if c.rank is not None and self._owner.get(c.rank) == conn:
            del self._owner[c.rank]
            if not (c.finalized or c.aborted):
                actions.append(RankFailed(c.rank, f"broke the PMI protocol: {why}"))
        return actions

    def _bind(self, conn: int, rank: int) -> None:
        self._conns[conn].rank = rank
        self._owner[rank] = conn
        self._claimed.add(rank)

    # ----- requests ----------------------------------------------------------------------------

    def _initack(self, conn: int, c: _Conn, cmd: PmiCommand) -> list[Action]:
        rank = self._tokens.pop(cmd.get("pmiid", ""), None)
        if rank is None:
            return self._reject(conn, "unknown or already used PMI_ID")
        if rank in self._claimed:  # an id minted for a rank that connected via PMI_FD
            return self._reject(conn, f"rank {rank} already has a PMI connection")
        self._bind(conn, rank)
        c.started = True
        sets = f"cmd=set size={self._world}\ncmd=set rank={rank}\ncmd=set debug=0\n"
        return [Reply(conn, format_reply("initack", rc=0) + sets.encode())]

    def _init(self, conn: int, c: _Conn, cmd: PmiCommand) -> list[Action]:
        if cmd.get("pmi_version") != "1":
            # PMI-2 clients start with a v1-framed init; refuse so they fail cleanly (flux does).
            return [Reply(conn, format_reply(
                "response_to_init", rc=-1, pmi_version=1, pmi_subversion=1,
                msg="dtrain_serves_PMI-1_only"))]
        c.initialized = True
        return [Reply(conn, format_reply("response_to_init", rc=0, pmi_version=1,
                                         pmi_subversion=1))]

    def _fixed_reply(self, conn: int, c: _Conn, cmd: PmiCommand) -> list[Action]:
        return [Reply(conn, self._fixed[cmd.cmd])]

    def _put(self, conn: int, c: _Conn, cmd: PmiCommand) -> list[Action]:
        key, value = cmd.get("key", ""), cmd.get("value", "")
        problem = self._kv_problem(cmd) or _value_problem(key, value)
        if problem:
            return [Reply(conn, format_reply("put_result", rc=1, msg=problem))]
        self._cache[key] = self._epoch_puts[key] = value
        return [Reply(conn, format_reply("put_result", rc=0))]

    def _get(self, conn: int, c: _Conn, cmd: PmiCommand) -> list[Action]:
        key = cmd.get("key")
        problem = self._kv_problem(cmd)
        if problem:
            return [Reply(conn, format_reply("get_result", rc=1, msg=problem))]
        value = self._attrs.get(key) if key in self._attrs else self._cache.get(key)
        if value:  # an empty job attribute is absent: MPICH cannot parse "value="
            return [Reply(conn, format_reply("get_result", rc=0, value=value))]
        if key in self._attrs or key.startswith("PMI_"):
            return [Reply(conn, format_reply("get_result", rc=1, msg="not_available"))]
        c.pending, self._next_req = "get", self._next_req + 1
        self._gets[self._next_req] = (conn, key)
        return [Send({"op": "get", "key": key, "req": self._next_req})]

    def _kv_problem(self, cmd: PmiCommand) -> str:
        key = cmd.get("key")
        if cmd.get("kvsname") != self._kvsname:
            return "unknown_kvsname"
        if not key:
            return "key_missing"
        return f"key_longer_than_{KEYLEN_MAX}" if len(key) > KEYLEN_MAX else ""

    def _barrier_in(self, conn: int, c: _Conn, cmd: PmiCommand) -> list[Action]:
        c.pending = "barrier"
        self._barrier.add(c.rank)
        if len(self._barrier) < len(self._ranks):
            return []
        puts, self._epoch_puts = self._epoch_puts, {}
        return [Send({"op": "barrier_in", "puts": puts})]

    def _finalize(self, conn: int, c: _Conn, cmd: PmiCommand) -> list[Action]:
        c.finalized = True
        return [Reply(conn, format_reply("finalize_ack", rc=0))]

    def _abort(self, conn: int, c: _Conn, cmd: PmiCommand) -> list[Action]:
        text = cmd.get("exitcode", cmd.get("exit_code", "1"))  # flux's spelling too
        try:
            code = int(text)
        except ValueError:
            code = 1
        message = cmd.get("message", cmd.get("error_msg", ""))
        c.aborted = True
        return [Abort(c.rank, code, message),
                Send({"op": "abort", "rank": c.rank, "code": code, "message": message})]

    def _refuse(self, conn: int, name: str) -> Reply:
        reply, feature = _UNSUPPORTED[name]
        return Reply(conn, format_reply(reply, rc=-1, msg=f"dtrain_does_not_support_{feature}"))

    def _spawn_line(self, conn: int, c: _Conn, line: bytes) -> list[Action]:
        """Swallow the mcmd=spawn block, then refuse it as a whole."""
        if not c.spawn.feed(line):
            return []
        c.spawn = None
        return [self._refuse(conn, "spawn")]

    # ----- head messages -----------------------------------------------------------------------

    def _barrier_out(self, kv: object) -> list[Action]:
        if not isinstance(kv, dict):
            raise _relay_error("barrier_out without a kv object")
        if len(self._barrier) < len(self._ranks):
            raise _relay_error("barrier_out before every local rank entered the barrier")
        self._cache.update(kv)
        self._epoch += 1
        actions: list[Action] = []
        for rank in sorted(self._barrier):
            conn = self._owner.get(rank)
            if conn is not None:
                self._conns[conn].pending = None
                actions.append(Reply(conn, format_reply("barrier_out", rc=0)))
        self._barrier.clear()
        return actions

    def _get_result(self, msg: Mapping) -> list[Action]:
        entry = self._gets.pop(msg.get("req"), None)
        if entry is None:
            raise _relay_error(f"get_result for unknown request {msg.get('req')!r}")
        conn, key = entry
        c = self._conns.get(conn)
        if c is None:
            return []  # the asker is gone
        c.pending = None
        value = msg.get("value")
        if msg.get("found") and isinstance(value, str) and value:
            self._cache[key] = value
            return [Reply(conn, format_reply("get_result", rc=0, value=value))]
        return [Reply(conn, format_reply("get_result", rc=1, msg="key_not_found"))]


def shm_segment_prefixes(kvsname: str) -> tuple[str, str]:
    """Name prefixes of the /dev/shm segments MPICH ranks of this job create on a host.

    MPICH names its node-local segments ``mpich_shm_<world_id>_<node>`` and
    ``mpich_vci_<world_id>_<node>``, ``world_id`` being the 32-bit FNV-1a hash of the kvsname
    (``mpir_pmi.c``, ``posix_init.c``), and nothing removes them when ranks are killed. Two
    consequences: the kvsname must be unique per job (a stale segment of the same name makes
    MPI_Init fail with "Out of memory"), and an agent that kills its ranks should remove the
    files under /dev/shm that start with these prefixes.
    """
    world_id = 2166136261
    for byte in kvsname.encode("utf-8"):
        world_id = ((world_id ^ byte) * 16777619) & 0xFFFFFFFF
    return f"mpich_shm_{world_id:x}_", f"mpich_vci_{world_id:x}_"


def _value_problem(key: str, value: str) -> str:
    if key.startswith("PMI_"):
        return "keys_with_PMI_prefix_are_reserved"  # Hydra's rule: they are job attributes
    if not value:
        return "empty_value"  # a reply "value=" would not parse in MPICH's client
    return f"value_longer_than_{VALLEN_MAX}" if len(value) > VALLEN_MAX else ""


def _relay_error(why: str) -> PmiError:
    return PmiError("PMI relay message rejected", "head", why,
                    "This is a bug in dtrain; please report it with the agent log")
