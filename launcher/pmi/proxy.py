"""The per-host PMI-1 proxy core: serves the ranks of one host, relays to the head.

Pure: the agent's adapter owns the sockets, calls ``open``/``feed``/``closed`` with what they
did, ``upstream`` with what the head sent, and carries out the returned actions in order
(`launcher.pmi.actions`, which also describes the upstream protocol and the stateless rules).
Like Hydra's ``pmi_proxy`` it answers everything it can locally (init, maxes, job attributes,
puts, gets of keys it has cached) and talks to the head only to combine barriers, one message
per host per barrier carrying every put of this host since the previous barrier, which keeps
the head at O(hosts) messages instead of O(ranks).

A fence whose cards were too many to push (``"held"``: their bytes, `launcher.pmi.kvs`)
leaves them above: each get this host cannot answer goes up, until the gets sent for that
epoch would have cost as much as all of its cards (`GET_COST_BYTES` each); the next miss
fetches every card in one ``fetch`` and the gets that arrive meanwhile wait for it. That is
the ski-rental rule: a rank that wires up to a few peers sends a few gets, MPICH's default
address exchange (every host reads every card) costs at most twice what the push did. In
bytes; in time a rank's gets are serial (MPICH waits for each answer), so one rank that has
read `DENSE_GETS` cards from above is taken for what it is, a rank reading them all, and its
next miss fetches: 64 namespace hosts x 1 MPICH rank (10 keys of 6.6 KB a rank, 426 KB held)
sent 104 gets a host one after another before fetching, 9.4 of the 13.7 s from the last
rank's start to all wired (traced at the head and agents).

MPICH says so itself: its all-gathers name their keys (`actions.ALLGATHER_KEY`) and every host
reads every key of one, so a miss on one fetches at once (no get goes up). Without that, 16
serial gets a host went up first: 16,000 round trips through the head at 1,024 hosts, most of
its CPU in MPICH's exchange (`bench.sim_scale`). The ski-rental rule stays for other keys.

Failure rules (Hydra's): a rank whose connection closes after it spoke PMI but before
``finalize`` has failed; a connection that never sent a byte (a non-MPI program) has not.
A line that is not PMI, a request out of order or a second request while one is pending closes
that connection; a connection that is not (yet) some rank's - a wrong ``PMI_ID``, a rank
claimed twice - is closed without touching anything else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from launcher.pmi import actions, stall
from launcher.pmi.actions import Action, Close, Conn, RankFailed, Reply, Send
from launcher.pmi.codec import (
    PmiCommand,
    PmiProtocolError,
    SpawnBlock,
    format_reply,
    found_reply,
    get_line_pattern,
    parse_line,
)

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from typing import Any

#: What one get answered from above costs, in bytes of cards moved instead: a round trip
#: through every level up to the key (a frame, its JSON and a thread hop at each) costs about
#: what 4 KiB of cards does to send and decode.
GET_COST_BYTES = 4096
#: Cards one rank reads from above in one epoch before its host fetches them all: more than a
#: ring's, a tree's or a few neighbours' (a rank that wires up lazily), what MPICH's default
#: exchange reads of 2 peers (its cards are 10 keys a rank).
DENSE_GETS = 16


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
        if len(process_mapping) > actions.VALLEN_MAX:
            process_mapping = ""
        self._attrs = {"PMI_process_mapping": process_mapping, "universeSize": str(world_size)}
        self._tokens = dict(id_tokens or {})
        self._conns: dict[int, Conn] = {}
        self._owner: dict[int, int] = {}            # rank -> its connection
        self._claimed: set[int] = set()             # ranks ever bound (a rank connects once)
        self._spoke: set[int] = set()               # ranks that sent PMI (began MPI_Init)
        self._left_silent: set[int] = set()         # ranks gone without a PMI word
        self._cache: dict[str, str] = {}
        self._epoch_puts: dict[str, str] = {}
        self._barrier: set[int] = set()
        self.fenced: frozenset[int] = frozenset()  # in a barrier: MPI_Init or MPI_Finalize
        self._gets: dict[int, tuple[int, str]] = {}  # req -> (conn, key)
        self._next_req = 0
        self._epoch = 0
        self._held = 0           # bytes of cards the last fence left above (0: pushed or none)
        self._asked = 0          # gets sent up since that fence
        self._asked_by: dict[int, int] = {}  # rank -> of those, its own
        self._fetch = False      # a fetch under way, and the gets waiting on it:
        self._after_fetch: list[tuple[int, str]] = []  # (conn, key)
        self._get_line = get_line_pattern(kvsname, actions.KEYLEN_MAX)
        self._fixed = actions.fixed_replies(world_size=world_size, kvsname=kvsname, appnum=appnum)
        # (connection, its rank, its state, the request) -> what to do
        self._handlers: dict[str, Callable[[int, int, Conn, PmiCommand], list[Action]]] = {
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
        self._conns[conn] = Conn(rank=None)
        if rank is not None:
            self._bind(conn, rank)
        return []

    def feed(self, conn: int, data: bytes) -> list[Action]:
        """Raw bytes read from ``conn``."""
        c = self._conns.get(conn)
        if c is None:
            return []
        if c.initialized and (reply := self._cached_get(c, data)) is not None:
            return [Reply(conn, reply)]
        c.started = c.started or (c.rank is not None and bool(data))
        if c.started and c.rank is not None:
            self._spoke.add(c.rank)
        error = None
        try:
            lines = c.lines.feed(data)
        except PmiProtocolError as exc:
            lines, error = list(exc.lines), exc
        out: list[Action] = []
        for line in lines:
            out += self._line(conn, c, line)
            if conn not in self._conns:
                return out
        if error is not None:
            out += self._reject(conn, error.why)
        return out

    def fast_get(self, conn: int, data: bytes) -> bytes | None:
        """The reply to ``data`` read from ``conn`` when it is one plain get `_cached_get`
        answers, as bytes to send (what `feed` would return in a `Reply`); None for anything
        else, which goes to `feed`. The adapter's hot path: 640 gets a rank at 64 ranks."""
        c = self._conns.get(conn)
        if c is None or not c.initialized:
            return None
        return self._cached_get(c, data)

    def closed(self, conn: int) -> list[Action]:
        """``conn`` reached EOF (or broke)."""
        c = self._conns.pop(conn, None)
        if c is None or c.rank is None or self._owner.get(c.rank) != conn:
            return []
        del self._owner[c.rank]
        if not c.started:
            self._left_silent.add(c.rank)
        if c.started and not (c.finalized or c.aborted):
            return [RankFailed(c.rank, "closed its PMI connection before finalize")]
        return []

    def upstream(self, msg: Mapping[str, Any]) -> list[Action]:
        """A message from the head."""
        op = msg.get("op")
        if op == "barrier_out":
            return self._barrier_out(msg.get("kv"), msg.get("held", 0))
        if op == "get_result":
            return self._get_result(msg)
        if op == "cards":
            return self._cards(msg)
        if op == "push":  # a fence's cards ahead of its barrier_out: kept, nobody released
            if not isinstance(kv := msg.get("kv"), dict):
                raise actions.relay_error("push without a kv object")
            self._cache.update(kv)
            return []
        raise actions.relay_error(f"unknown op {op!r}")

    def exited(self, rank: int) -> None:
        """The agent saw ``rank``'s process exit (PMI_PORT mode has no socket to tell it)."""
        if rank in self._ranks and rank not in self._spoke:
            self._left_silent.add(rank)

    @property
    def epoch(self) -> int:
        """Completed barriers: names the barrier under way."""
        return self._epoch

    def rank_of(self, conn: int) -> int | None:
        """The rank ``conn`` serves; None until it presents a valid PMI_ID (PMI_PORT mode)."""
        return c.rank if (c := self._conns.get(conn)) is not None else None

    def holding_up(self, host_waited: bool = False) -> tuple[list[int], list[int]]:
        """(missing, gone): see `launcher.pmi.stall.holding_up`."""
        return stall.holding_up(self._ranks, self._barrier, self._spoke, self._left_silent,
                                host_waited=host_waited)

    def _cached_get(self, c: Conn, data: bytes) -> bytes | None:
        """The fast path of a wire-up: ``data`` is exactly one plain get of a key this host
        holds, from a rank in the middle of nothing else, so its reply is the value (what
        `_line` and `_get` would answer, without the generic parse, order check and format).
        None for anything else, which takes the generic path. MPICH reads every card with one
        get at a time (640 a rank at 64 ranks), and the generic path cost ~25 us of the
        agent's CPU per get (~2 here) on cores its ranks share (`bench.hosts_scale`)."""
        if (self._get_line is None or c.finalized or c.aborted or c.pending or c.spawn
                or c.lines.pending or c.rank is None):
            return None
        match = self._get_line.fullmatch(data)
        if match is None:
            return None
        key = match.group(1).decode("ascii")
        value = None if key in self._attrs else self._cache.get(key)
        return found_reply(value) if value else None

    # ----- one line ----------------------------------------------------------------------------

    def _line(self, conn: int, c: Conn, line: bytes) -> list[Action]:
        if c.aborted:
            return []  # MPICH may still send barrier_in on its way out; the job is going down
        try:
            if c.spawn is not None and c.rank is not None:  # a spawn block follows binding
                return self._spawn_line(conn, c.rank, c, c.spawn, line)
            cmd = parse_line(line)
        except PmiProtocolError as exc:
            return self._reject(conn, exc.why)
        problem = actions.order_problem(cmd, bound=c.rank is not None, known=self._handlers,
                                        initialized=c.initialized, finalized=c.finalized,
                                        pending=c.pending)
        if problem:
            return self._reject(conn, problem)
        if c.rank is None:
            return self._initack(conn, c, cmd)
        if cmd.multiline:
            c.spawn = SpawnBlock()
            return []
        if cmd.cmd in actions.UNSUPPORTED:
            return actions.refusal(conn, c.rank, cmd.cmd)
        return self._handlers[cmd.cmd](conn, c.rank, c, cmd)

    def _reject(self, conn: int, why: str) -> list[Action]:
        c = self._conns.pop(conn)
        out: list[Action] = [Close(conn, why)]
        if c.rank is not None and self._owner.get(c.rank) == conn:
            del self._owner[c.rank]
            if not (c.finalized or c.aborted):
                out.append(RankFailed(c.rank, f"broke the PMI protocol: {why}"))
        return out

    def _bind(self, conn: int, rank: int) -> None:
        self._conns[conn].rank = rank
        self._owner[rank] = conn
        self._claimed.add(rank)

    # ----- requests ----------------------------------------------------------------------------

    def _initack(self, conn: int, c: Conn, cmd: PmiCommand) -> list[Action]:
        rank = self._tokens.pop(cmd.value("pmiid"), None)
        if rank is None:
            return self._reject(conn, "unknown or already used PMI_ID")
        if rank in self._claimed:  # an id minted for a rank that connected via PMI_FD
            return self._reject(conn, f"rank {rank} already has a PMI connection")
        self._bind(conn, rank)
        c.started = True
        self._spoke.add(rank)
        sets = f"cmd=set size={self._world}\ncmd=set rank={rank}\ncmd=set debug=0\n"
        return [Reply(conn, format_reply("initack", rc=0) + sets.encode())]

    def _init(self, conn: int, rank: int, c: Conn, cmd: PmiCommand) -> list[Action]:
        if cmd.get("pmi_version") != "1":
            # PMI-2 clients start with a v1-framed init; refuse so they fail cleanly (flux does).
            return [Reply(conn, format_reply(
                "response_to_init", rc=-1, pmi_version=1, pmi_subversion=1,
                msg="dtrain_serves_PMI-1_only"))]
        c.initialized = True
        return [Reply(conn, format_reply("response_to_init", rc=0, pmi_version=1,
                                         pmi_subversion=1))]

    def _fixed_reply(self, conn: int, rank: int, c: Conn, cmd: PmiCommand) -> list[Action]:
        return [Reply(conn, self._fixed[cmd.cmd])]

    def _put(self, conn: int, rank: int, c: Conn, cmd: PmiCommand) -> list[Action]:
        key, value = cmd.value("key"), cmd.value("value")
        problem = actions.key_problem(cmd, self._kvsname) or actions.value_problem(key, value)
        if problem:
            return [Reply(conn, format_reply("put_result", rc=1, msg=problem))]
        self._cache[key] = self._epoch_puts[key] = value
        return [Reply(conn, format_reply("put_result", rc=0))]

    def _get(self, conn: int, rank: int, c: Conn, cmd: PmiCommand) -> list[Action]:
        key = cmd.value("key")
        problem = actions.key_problem(cmd, self._kvsname)
        if problem:
            return [Reply(conn, format_reply("get_result", rc=1, msg=problem))]
        value = self._attrs.get(key) if key in self._attrs else self._cache.get(key)
        if value:  # an empty job attribute is absent: MPICH cannot parse "value="
            return [Reply(conn, found_reply(value))]
        if key in self._attrs or key.startswith("PMI_"):
            return [Reply(conn, format_reply("get_result", rc=1, msg="not_available"))]
        c.pending, self._next_req = "get", self._next_req + 1
        if self._fetch:
            self._after_fetch.append((conn, key))
            return []
        if self._held and (actions.is_allgather_key(key)
                           or self._asked * GET_COST_BYTES >= self._held
                           or self._asked_by.get(rank, 0) >= DENSE_GETS):
            self._fetch, self._held = True, 0  # once per fence
            self._after_fetch.append((conn, key))
            return [Send({"op": "fetch"})]
        self._asked += 1
        self._asked_by[rank] = self._asked_by.get(rank, 0) + 1
        self._gets[self._next_req] = (conn, key)
        return [Send({"op": "get", "key": key, "req": self._next_req})]

    def _barrier_in(self, conn: int, rank: int, c: Conn, cmd: PmiCommand) -> list[Action]:
        c.pending = "barrier"
        self._barrier.add(rank)
        self.fenced = frozenset(self._barrier)
        if len(self._barrier) < len(self._ranks):
            return []
        puts, self._epoch_puts = self._epoch_puts, {}
        return [Send({"op": "barrier_in", "puts": puts})]

    def _finalize(self, conn: int, rank: int, c: Conn, cmd: PmiCommand) -> list[Action]:
        c.finalized = True
        return [Reply(conn, format_reply("finalize_ack", rc=0))]

    def _abort(self, conn: int, rank: int, c: Conn, cmd: PmiCommand) -> list[Action]:
        c.aborted = True
        return actions.abort_actions(rank, cmd)

    def _spawn_line(self, conn: int, rank: int, c: Conn, spawn: SpawnBlock,
                    line: bytes) -> list[Action]:
        """Swallow the mcmd=spawn block, then refuse it as a whole."""
        if not spawn.feed(line):
            return []
        c.spawn = None
        return actions.refusal(conn, rank, "spawn")

    # ----- head messages -----------------------------------------------------------------------

    def _barrier_out(self, kv: object, held: object = 0) -> list[Action]:
        if not isinstance(kv, dict):
            raise actions.relay_error("barrier_out without a kv object")
        if len(self._barrier) < len(self._ranks):
            raise actions.relay_error("barrier_out before every local rank entered the barrier")
        self._cache.update(kv)
        self._held, self._asked = (held if isinstance(held, int) else 0), 0
        self._asked_by = {}
        self._epoch += 1
        out: list[Action] = []
        for rank in sorted(self._barrier):
            conn = self._owner.get(rank)
            if conn is not None:
                self._conns[conn].pending = None
                out.append(Reply(conn, format_reply("barrier_out", rc=0)))
        self._barrier, self.fenced = set(), frozenset()
        return out

    def _get_result(self, msg: Mapping[str, Any]) -> list[Action]:
        req = msg.get("req")
        entry = self._gets.pop(req, None) if isinstance(req, int) else None
        if entry is None:
            raise actions.relay_error(f"get_result for unknown request {msg.get('req')!r}")
        conn, key = entry
        c = self._conns.get(conn)
        if c is None:
            return []  # the asker is gone
        c.pending = None
        value = msg.get("value")
        if msg.get("found") and isinstance(value, str) and value:
            self._cache[key] = value
            return [Reply(conn, found_reply(value))]
        return [Reply(conn, format_reply("get_result", rc=1, msg="key_not_found"))]

    def _cards(self, msg: Mapping[str, Any]) -> list[Action]:
        """The fetch's answer: every committed card; the gets that waited on it answered."""
        kv = msg.get("kv")
        if not self._fetch or not isinstance(kv, dict):
            raise actions.relay_error("cards without a fetch under way")
        self._cache.update(kv)
        self._fetch, waiting, self._after_fetch = False, self._after_fetch, []
        out: list[Action] = []
        for conn, key in waiting:
            c = self._conns.get(conn)
            if c is None:
                continue  # the asker is gone
            c.pending = None
            if value := self._cache.get(key):
                out.append(Reply(conn, found_reply(value)))
            else:  # not committed: what the head answers a get for it
                out.append(Reply(conn, format_reply("get_result", rc=1, msg="key_not_found")))
        return out
