"""torch.distributed programs seen through torch's Flight Recorder, without their help (adapter).

A rank that does not use dtrain's trainer writes no progress record; one that uses
torch.distributed has torch's Flight Recorder, which records every collective of every process
group (op, group, sequence number, sizes, state) once ``TORCH_FR_BUFFER_SIZE`` is set. The
agent sets it (`ENTRIES`) unless the user set it or its NCCL name, and puts
`flight_shim` first on the ranks' PYTHONPATH: its ``sitecustomize`` reads the recorder from
a thread of the rank's own and writes each group's state beside the rank's progress record
(``DTRAIN_FLIGHT_FILE``), in the record's own fields. The agent reads that file where the rank
has no record (`read`), so the same views, hang clock, causes engine and stacks serve both.

Point-to-point operations are not in gloo's recorder (NCCL's has them, but only NCCL's): the
shim wraps the process group's ``send`` and ``recv`` on every backend and merges what they note
with the recorder's collectives (its docstring). What it cannot see: processes started with
``python -E``/``-I`` (they ignore PYTHONPATH), and programs that never initialise
torch.distributed (these get the stack-only diagnosis).
"""

from __future__ import annotations

import os

import workerenv

TYPE_CHECKING = False  # importing `typing` costs every agent's start-up; mypy reads True
if TYPE_CHECKING:
    from typing import Any

FILE = "DTRAIN_FLIGHT_FILE"
INTERVAL = "DTRAIN_FLIGHT_INTERVAL"
BUFFER = "TORCH_FR_BUFFER_SIZE"
BUFFER_NAMES = (BUFFER, "TORCH_NCCL_TRACE_BUFFER_SIZE")  # either turns the recorder on
# The recorder's ring, shared by every group of the rank. The reader dumps and parses all of
# it each interval (about 0.5 KiB of JSON per entry): 2000 entries cost ~0.1 s of the rank's
# GIL per read on a loaded host, 256 a few ms, and still hold the last 16 of each of a
# mesh's groups (the reader keeps 16 per group).
ENTRIES = 256
MAX_BYTES = 1 << 20
SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flight_shim")


def path(record: str) -> str:
    return record + ".flight.json"


def rank_env(env: dict[str, str], record: str, interval: float) -> dict[str, str]:
    """What a rank's environment gets so that its Flight Recorder is read: by the shim twice
    per agent's ``interval``, so the agent's reading lags the rank by half an interval at most
    (a hang's diagnosis comes that much sooner)."""
    extra = {FILE: path(record), INTERVAL: f"{interval / 2:g}",
             "PYTHONPATH": os.pathsep.join(p for p in (SHIM, env.get("PYTHONPATH")) if p)}
    if not any(env.get(name) for name in BUFFER_NAMES):
        extra[BUFFER] = str(ENTRIES)
    return extra


def left(file: str) -> bool:
    """The program left its main with torch.distributed up (the shim's marker): done with
    the job, whatever its teardown does (torch's threads can hold it there)."""
    return os.path.exists(file + ".left")


class FlightProgress(workerenv.RankProgress, frozen=True):
    """A rank's record read from the shim's file; ``spins``: a group's backend waits by
    spinning (NCCL's host side in CUDA's synchronisation), so CPU use is no sign of progress."""

    spins: bool = False


def read(file: str) -> FlightProgress | None:
    """The rank's groups as the shim last wrote them; None without a readable file (the file
    is the rank's: anything unexpected in it is no record)."""
    import json

    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            body = json.loads(f.read(MAX_BYTES + 1)[:MAX_BYTES])
        return FlightProgress(int(body["pid"]), int(body["rank"]), 0, 0.0, 0.0, 0.0,
                              tuple(_group(g) for g in body["groups"]),
                              spins=bool(body.get("spins", False)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def recorder(record: workerenv.RankProgress | None) -> str:
    """`RankView.recorder`: "flight" for a record of the shim's whose ranks block while they
    wait (gloo), "flight-spin" for one whose ranks spin (NCCL), "" for trainer.comm's own."""
    if not isinstance(record, FlightProgress):
        return ""
    return "flight-spin" if record.spins else "flight"


def _group(g: dict[str, Any]) -> workerenv.GroupProgress:
    return workerenv.GroupProgress(
        str(g["label"]), int(g["group_rank"]), int(g["group_size"]), int(g["seq"]),
        int(g["done"]), str(g["op"]), str(g["dtype"]), int(g["p2p"]), int(g["peer"]),
        int(g["nbytes"]), float(g["entered_at"]),
        tuple((int(s), str(o), int(p), int(n)) for s, o, p, n in g["history"]))
