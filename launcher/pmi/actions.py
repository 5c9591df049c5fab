"""What `launcher.pmi.proxy.PmiProxy` asks its adapter to do, the state of one rank's
connection (`Conn`), and the rules that need no more state than that.

The proxy returns a list of actions for every event; the agent carries them out in order:
`Reply` (bytes to a rank's connection), `Close` (drop a connection), `Send` (a message to the
head), `RankFailed` (a rank broke the job) and `Abort` (a rank called PMI abort).

Upstream protocol (JSON-able dicts; ``->`` is a `Send`, ``<-`` what ``PmiProxy.upstream``
takes; the head side is ``launcher.pmi.kvs``):

    -> {"op": "barrier_in", "puts": {key: value}}     every local rank entered the barrier
    <- {"op": "barrier_out", "kv": {key: value}}      all puts of all hosts in that epoch
    <- {"op": "barrier_out", "kv": {}, "held": b}     the same, b bytes of them left above
    <- {"op": "push", "kv": {key: value}}             cards for the cache, nobody released:
                                                      the head sends a fence's cards so to
                                                      every host, then each barrier_out
    -> {"op": "get", "key": k, "req": n}              a key this host has not seen
    <- {"op": "get_result", "req": n, "found": bool, "value": str}
    -> {"op": "fetch"}                                every committed key, at once
    <- {"op": "cards", "kv": {key: value}}            its answer (one fetch under way at most)
    -> {"op": "abort", "rank": r, "code": n, "message": s}
    -> {"op": "unsupported", "rank": r, "feature": f}  a rank asked for what dtrain refuses

The rest are the PMI-1 rules that need no proxy state: the limits, the order requests may come
in, the replies that never change during a job, refusals of what dtrain does not serve (spawn,
the name service), checks on keys and values, MPICH's all-gather keys, reading an abort
request, and the names of the shared-memory segments MPICH leaves behind.
"""

from __future__ import annotations

import re
from collections.abc import Container, Mapping

from launcher.errors import PmiError
from launcher.pmi.codec import LineBuffer, PmiCommand, SpawnBlock, format_reply
from records import Record, field

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from typing import Any

    #: An upstream message sent: a JSON object (received ones are read as Mapping[str, Any]).
    Message = dict[str, Any]

KVSNAME_MAX, KEYLEN_MAX, VALLEN_MAX = 256, 64, 1024
UNSUPPORTED = {  # request -> (reply, what to tell the user); no MPI_Comm_spawn, no name service
    "spawn": ("spawn_result", "MPI_Comm_spawn"),
    "publish_name": ("publish_result", "MPI_Publish_name"),
    "unpublish_name": ("unpublish_result", "MPI_Unpublish_name"),
    "lookup_name": ("lookup_result", "MPI_Lookup_name"),
}


class Reply(Record, frozen=True):
    conn: int
    data: bytes


class Close(Record, frozen=True):
    conn: int
    reason: str


class Send(Record, frozen=True):
    msg: Message


class RankFailed(Record, frozen=True):
    rank: int
    reason: str


class Abort(Record, frozen=True):
    rank: int
    code: int
    message: str


Action = Reply | Close | Send | RankFailed | Abort


class Conn(Record):
    """One PMI connection of the proxy: its rank once bound, where it is in the protocol."""

    rank: int | None
    lines: LineBuffer = field(default_factory=LineBuffer)
    started: bool = False       # spoke PMI (so closing before finalize is a failure)
    initialized: bool = False
    finalized: bool = False
    aborted: bool = False
    pending: str | None = None  # the request whose answer comes from the head
    spawn: SpawnBlock | None = None  # while swallowing an mcmd=spawn block


def order_problem(cmd: PmiCommand, *, bound: bool, initialized: bool, finalized: bool,
                  pending: str | None, known: Container[str]) -> str:
    """Why ``cmd`` may not come now on a connection, "" when it may (then it is served).

    ``bound``: the connection is some rank's (a PMI_PORT one is not until its initack);
    ``pending``: the request whose answer the head still owes it; ``known``: what is served.
    """
    name = cmd.cmd
    if not bound:
        return "" if name == "initack" else f"sent {name} before initack (PMI_PORT mode)"
    if finalized:
        return f"sent {name} after finalize"
    if name == "abort":
        return ""  # accepted even before init or with a request pending
    if pending:
        return f"sent {name} while its {pending} was pending (one request at a time)"
    if name == "initack":
        return "sent initack on a connection that already has a rank"
    if cmd.multiline and name != "spawn":
        return f"unknown multi-line command mcmd={name}"
    if name not in known and name not in UNSUPPORTED:
        return f"unknown command {name}"
    if not initialized and name != "init":
        return f"sent {name} before init"
    if initialized and name == "init":
        return "sent init twice"
    return ""


def fixed_replies(*, world_size: int, kvsname: str, appnum: int) -> dict[str, bytes]:
    """The replies to requests whose answer never changes during the job."""
    return {
        "get_maxes": format_reply("maxes", rc=0, kvsname_max=KVSNAME_MAX,
                                  keylen_max=KEYLEN_MAX, vallen_max=VALLEN_MAX),
        "get_appnum": format_reply("appnum", rc=0, appnum=appnum),
        "get_my_kvsname": format_reply("my_kvsname", rc=0, kvsname=kvsname),
        "get_universe_size": format_reply("universe_size", rc=0, size=world_size),
    }


def refusal(conn: int, rank: int, name: str) -> list[Action]:
    """The failed reply to an `UNSUPPORTED` request, naming the MPI feature, and the notice
    that lets the head tell the user in dtrain's words (MPICH only prints a generic error)."""
    reply, feature = UNSUPPORTED[name]
    return [Reply(conn, format_reply(reply, rc=-1, msg=f"dtrain_does_not_support_{feature}")),
            Send({"op": "unsupported", "rank": rank, "feature": feature})]


def key_problem(cmd: PmiCommand, kvsname: str) -> str:
    """Why a put or get of ``cmd``'s key is refused (a PMI ``msg`` word), "" when it is fine."""
    key = cmd.get("key")
    if cmd.get("kvsname") != kvsname:
        return "unknown_kvsname"
    if not key:
        return "key_missing"
    return f"key_longer_than_{KEYLEN_MAX}" if len(key) > KEYLEN_MAX else ""


def value_problem(key: str, value: str) -> str:
    """Why a put of ``key=value`` is refused (a PMI ``msg`` word), "" when it is fine."""
    if key.startswith("PMI_"):
        return "keys_with_PMI_prefix_are_reserved"  # Hydra's rule: they are job attributes
    if not value:
        return "empty_value"  # a reply "value=" would not parse in MPICH's client
    return f"value_longer_than_{VALLEN_MAX}" if len(value) > VALLEN_MAX else ""


def abort_actions(rank: int, cmd: PmiCommand) -> list[Action]:
    """``rank`` asked to abort: tell the adapter and the head, with its code and message."""
    text = cmd.value("exitcode", cmd.value("exit_code", "1"))  # flux's spelling too
    try:
        code = int(text)
    except ValueError:
        code = 1
    message = cmd.value("message", cmd.value("error_msg"))
    return [Abort(rank, code, message),
            Send({"op": "abort", "rank": rank, "code": code, "message": message})]


def push_and_release(out: Mapping[str, Any]) -> tuple[Message | None, Message]:
    """A host's ``barrier_out``, split: the ``push`` that carries its cards (None when it has
    none) and its release, without them. Whoever sends a fence's answer (the head, and each
    relay for its own hosts) sends every host its push before any host's release: sent with
    the releases, the last of 64 namespace hosts got its cards ~1 s after the first, while
    the first hosts' ranks, through with their gets, spun in MPI_Init on the cores it shared
    (`bench.hosts_scale`)."""
    if not out.get("kv"):
        return None, dict(out)
    return {"op": "push", "kv": out["kv"]}, {**out, "kv": {}}


#: The keys of MPICH's all-gathers over PMI (``mpir_pmi.c`` of MPICH 4-5; the format strings
#: are in this machine's ``libmpi.so``): ``-allgather-<seq>-<rank>`` (``MPIR_pmi_allgather``:
#: every rank of its domain, all ranks or each host's first, reads every key) and
#: ``-allgather-shm-<seq>-<rank>`` (``MPIR_pmi_allgather_shm``: a host's ranks split the keys
#: and read them all into shared memory), a value longer than one PMI value put as
#: ``segments=<n>`` under the key and its parts under ``<key>-seg-<i>/<n>``. ch4's address
#: exchange is one of these (``-allgather-1-<host>``, traced under Hydra). Not its group
#: all-gather (``-allgather-group-<seq>``...: a group's members read only the group's keys).
ALLGATHER_KEY = re.compile(r"-allgather-(?:shm-)?[0-9]+-[0-9]+(?:-seg-[0-9]+/[0-9]+)?")


def is_allgather_key(key: str) -> bool:
    """A key of one of MPICH's all-gathers (`ALLGATHER_KEY`): after the fence that committed
    it, this host reads every card of that fence, so its first miss fetches them all."""
    return ALLGATHER_KEY.fullmatch(key) is not None


def relay_error(why: str) -> PmiError:
    """A message from the head the proxy cannot apply: always a dtrain bug."""
    return PmiError("PMI relay message rejected", "head", why,
                    "This is a bug in dtrain; please report it with the agent log")


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
