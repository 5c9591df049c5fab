"""dtrain's reader of torch's Flight Recorder, loaded into each rank by Python's ``site``.

The agent puts this folder first on the ranks' PYTHONPATH (`launcher.agent.flight`). In a
process of a dtrain job (``DTRAIN_FLIGHT_FILE`` set) it starts one daemon thread that sleeps
until the program has initialised torch.distributed, then every ``DTRAIN_FLIGHT_INTERVAL``
seconds reads the Flight Recorder (``_dump_fr_trace_json``: every process group's collectives
with their sequence numbers, states and sizes; on by ``TORCH_FR_BUFFER_SIZE``) and writes what
the hang diagnosis needs, per group, as JSON in `workerenv.GroupProgress`'s fields, to that
file (atomically). The program is not changed and never waits for it: the thread reads while
the program's own thread blocks in a collective (the GIL is released there), and any error
of its own stops it silently. Processes that never initialise torch.distributed (data-loader
workers, tools) only sleep. Afterwards Python's own ``sitecustomize`` lookup goes on to the
next one on the path, so a user's is still run.

Standard library only, and nothing heavy at start-up: every Python process of the rank pays it.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # `typing` is not imported by every Python process of a rank
if TYPE_CHECKING:
    from typing import Any


def _main() -> None:
    path = os.environ.get("DTRAIN_FLIGHT_FILE")
    if path:
        import threading

        interval = float(os.environ.get("DTRAIN_FLIGHT_INTERVAL", "1"))
        threading.Thread(target=_run, args=(path, interval), name="dtrain-flight",
                         daemon=True).start()
        # When the main thread is done (before the interpreter's atexit handlers): the program
        # left its main while torch.distributed is up; its teardown may hang on torch's
        # threads. Only a marker file: nothing of torch is touched there.
        hook = getattr(threading, "_register_atexit", None)
        if hook is not None:
            hook(_left, path)
    _next_sitecustomize()


def _run(path: str, interval: float) -> None:
    import time

    pid = os.getpid()
    while True:
        time.sleep(interval)
        if os.getpid() != pid:  # a forked child: the parent's recorder is not its own
            return
        dist = sys.modules.get("torch.distributed")
        try:
            ready = dist is not None and dist.is_available() and dist.is_initialized()
        except AttributeError:  # the program's thread is still importing it
            continue
        if not ready:
            continue
        try:
            _write(path, _summary(dist))
        except Exception:  # never disturb the program: no more records from this process
            return


def _left(path: str) -> None:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            with open(path + ".left", "w") as f:
                f.write(str(os.getpid()))
    except Exception:
        pass


_DTYPES = {"Float": ("float32", 4), "Double": ("float64", 8), "Half": ("float16", 2),
           "BFloat16": ("bfloat16", 2), "Long": ("int64", 8), "Int": ("int32", 4),
           "Char": ("int8", 1), "Byte": ("uint8", 1), "Bool": ("bool", 1)}
_HISTORY = 16


def _summary(dist: Any) -> dict[str, Any]:
    import json
    import time

    from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]

    c10d = dist.distributed_c10d
    trace = json.loads(_dump_fr_trace_json(includeCollectives=True))
    status = trace.get("pg_status", {})
    by_pg: dict[str, list[dict[str, Any]]] = {}
    for e in trace.get("entries", ()):
        by_pg.setdefault(str(e.get("process_group", ["?"])[0]), []).append(e)
    me = dist.get_rank()
    now_ns, mono = time.time_ns(), time.monotonic()
    groups = []
    for pg, name in list(c10d._world.pg_names.items()):
        members = c10d._world.pg_group_ranks.get(pg, {})
        entries = sorted((e for e in by_pg.get(str(name), ()) if not e.get("is_p2p")),
                         key=lambda e: e["collective_seq_id"])[-_HISTORY:]
        # pg_status is keyed by the recorder's own id of the group, which is this process's
        # count of groups it is in: not the name, which every process agrees on.
        mine = status.get(str(entries[-1].get("pg_id"))) if entries else None
        if me not in members or not mine:
            continue
        last = entries[-1]
        dtype, size = _DTYPES.get((last.get("input_dtypes") or [""])[0], ("", 0))
        numel = sum(_numel(s) for s in last.get("input_sizes") or ())
        groups.append({
            "label": _label(pg, name, len(members), c10d), "group_rank": members[me],
            "group_size": len(members),
            "seq": max(0, int(mine.get("last_enqueued_collective", 0))),
            "done": max(0, int(mine.get("last_completed_collective", 0))),
            "op": _op(last), "dtype": dtype, "p2p": 0, "peer": -1, "nbytes": numel * size,
            "entered_at": mono - max(0, now_ns - int(last["time_created_ns"])) / 1e9,
            "history": [[e["collective_seq_id"], _op(e), -1, e["collective_seq_id"]]
                        for e in entries]})
    return {"pid": os.getpid(), "rank": me, "groups": groups}


def _label(pg: Any, name: str, size: int, c10d: Any) -> str:
    """``world``; ``mesh_tp[3]`` for a group torch made with a description (DeviceMesh's); else
    ``group2[3]``: groups of one size are taken to run one program (as a mesh's are), the
    family the diagnosis compares (`launcher.hang.model.family`)."""
    if pg is c10d._world.default_pg:
        return "world"
    desc = getattr(pg, "group_desc", "") or ""
    return f"{desc}[{name}]" if desc and desc != "undefined" else f"group{size}[{name}]"


def _op(entry: dict[str, Any]) -> str:
    return str(entry.get("profiling_name", "")).rpartition(":")[2]


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _write(path: str, body: dict[str, Any]) -> None:
    import json

    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(body, f)
    os.replace(tmp, path)


def _next_sitecustomize() -> None:
    """Run the sitecustomize this one hides (a user's, or the environment's), if any."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_main()
