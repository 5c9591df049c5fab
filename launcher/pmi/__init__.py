"""PMI-1 for MPICH-ABI workers, served without mpiexec (docs/design.md section 3).

    codec   lines on the wire: parse a request, format a reply, cut the stream into lines
    proxy   PmiProxy, the per-host core the agent runs: serves its ranks, relays to the head
    kvs     KeyValueSpace, the head's core: combines barriers across hosts, answers gets

All three are pure; the agent and the supervisor own the sockets and call them.
"""

from launcher.pmi.actions import (
    Abort,
    Action,
    Close,
    RankFailed,
    Reply,
    Send,
    shm_segment_prefixes,
)
from launcher.pmi.codec import (
    MAX_LINE,
    LineBuffer,
    PmiCommand,
    PmiProtocolError,
    format_reply,
    parse_line,
)
from launcher.pmi.kvs import KeyValueSpace
from launcher.pmi.proxy import PmiProxy

__all__ = [
    "MAX_LINE",
    "Abort",
    "Action",
    "Close",
    "KeyValueSpace",
    "LineBuffer",
    "PmiCommand",
    "PmiProtocolError",
    "PmiProxy",
    "RankFailed",
    "Reply",
    "Send",
    "format_reply",
    "parse_line",
    "shm_segment_prefixes",
]
