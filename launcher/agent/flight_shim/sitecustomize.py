"""dtrain's reader of torch's Flight Recorder, loaded into each rank by Python's ``site``.

The agent puts this folder first on the ranks' PYTHONPATH (`launcher.agent.flight`). In a
process of a dtrain job (``DTRAIN_FLIGHT_FILE`` set) that imports torch.distributed it starts
one daemon thread that sleeps until the program has initialised it, then every
``DTRAIN_FLIGHT_INTERVAL`` seconds reads the Flight Recorder (``_dump_fr_trace_json``: every
process group's collectives with their sequence numbers, states and sizes; on by
``TORCH_FR_BUFFER_SIZE``) and writes what the hang diagnosis needs, per group, as JSON in
`workerenv.GroupProgress`'s fields, to that file (atomically).

Point-to-point operations: gloo's recorder holds none (NCCL's does, but only NCCL's), so when
the program imports torch.distributed the shim wraps ``ProcessGroup.send`` and ``.recv``, which
every path to them goes through (``send``, ``isend``, ``batch_isend_irecv``, ``P2POp``), on
every backend alike: each call notes its group, peer (a group rank), tag, size and the time,
and a weak reference to the returned work, which tells whether it is still in flight (alive and
not ``is_completed()``; a blocking send drops its work when it returns). The ring keeps the last
`_HISTORY` per group and never holds a tensor. The reader merges them with the recorder's
collectives by the time each was entered (both clocks are the epoch's), so that the sequence
numbers count every operation as dtrain's trainer does and the collectives keep their count.

The program is not changed and never waits for the reader: the thread reads while the
program's own thread blocks in a collective (the GIL is released there), and any error of its
own stops it silently. Processes that never initialise torch.distributed (data-loader
workers, tools) only sleep; those that never import it have no thread at all. A sleeping
thread is not free: while the program's thread holds the GIL in C code, such as MPI_Init in
mpi4py's import, a thread due to wake waits for the GIL and wakes every 5 ms (the switch
interval), 200 wake-ups a second per rank on the cores the ranks and their agents share while
MPICH reads every peer's card (`bench.hosts_scale`). Afterwards Python's own
``sitecustomize`` lookup goes on to the next one on the path, so a user's is still run.

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
        sys.meta_path.insert(0, _AfterImport(
            "torch.distributed", lambda module: _distributed(module, path, interval)))
        # When the main thread is done (before the interpreter's atexit handlers): the program
        # left its main while torch.distributed is up. A marker file, then `_linger`.
        hook = getattr(threading, "_register_atexit", None)
        if hook is not None:
            hook(_left, path)
    _next_sitecustomize()


def _distributed(module: Any, path: str, interval: float) -> None:
    """The program imported torch.distributed: the reader starts, and point-to-point
    operations are noted from now on."""
    import threading

    threading.Thread(target=_run, args=(path, interval), name="dtrain-flight",
                     daemon=True).start()
    _wrap_p2p(module)


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
            # An uncaught exception ended it (printed, left in sys.last_value): it failed, and
            # its exit status is what the job needs, at once.
            if getattr(sys, "last_value", None) is None:
                _linger(dist)
    except Exception:
        pass


def _linger(dist: Any) -> None:
    """Stay until every rank of the job has left its main (counted in the program's own
    store), at most ``DTRAIN_FLIGHT_LINGER`` seconds. A rank that returns while the others
    still communicate would otherwise tear its process group down under them: gloo's
    teardown then hangs, aborts or exits at random, and the others fail with a closed
    connection or wait; lingering, it stays the rank that returned (the marker above) and the
    hang diagnosis names it. Ranks that all return together pass at once."""
    import time

    linger = float(os.environ.get("DTRAIN_FLIGHT_LINGER", "1800"))
    store = dist.distributed_c10d._get_default_store()
    world, key = dist.get_world_size(), "dtrain_flight_left"
    left, until = store.add(key, 1), time.monotonic() + linger
    while left < world and time.monotonic() < until:
        time.sleep(0.05)
        left = store.add(key, 0)


_DTYPES = {"Float": ("float32", 4), "Double": ("float64", 8), "Half": ("float16", 2),
           "BFloat16": ("bfloat16", 2), "Long": ("int64", 8), "Int": ("int32", 4),
           "Char": ("int8", 1), "Byte": ("uint8", 1), "Bool": ("bool", 1)}
_HISTORY = 16


class _AfterImport:
    """A finder that lets the import system load ``name`` as usual and then calls ``then``
    with the module (before the importer sees it); it steps aside after its one use."""

    def __init__(self, name: str, then: Any) -> None:
        self.name, self.then = name, then

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        if loader is not None and hasattr(loader, "exec_module"):
            run = loader.exec_module

            def exec_module(module: Any) -> None:
                run(module)
                try:
                    self.then(module)
                except Exception:  # never disturb the program: no point-to-point records
                    pass

            loader.exec_module = exec_module  # type: ignore[method-assign]  # its own loader
        return spec


class _Ring:
    """One group's point-to-point operations: how many were entered, the last `_HISTORY`
    as [index, op, peer, tag, nbytes, dtype, entered (epoch ns), weak ref to the work]."""

    def __init__(self) -> None:
        import collections

        self.count = 0
        self.last: Any = collections.deque(maxlen=_HISTORY)


_P2P: dict[int, _Ring] = {}   # id(process group) -> its ring (groups live as long as the job)


def _wrap_p2p(_: Any) -> None:
    from torch._C._distributed_c10d import ProcessGroup

    for name, side in (("send", "send"), ("recv", "recv")):
        setattr(ProcessGroup, name, _recorded(getattr(ProcessGroup, name), side))


def _recorded(call: Any, op: str) -> Any:
    import time
    import weakref

    def p2p(self: Any, *args: Any, **kw: Any) -> Any:
        at = time.time_ns()
        work = call(self, *args, **kw)
        try:  # the binding's parameters: tensors, dstRank or srcRank, tag
            rest = [kw.get("tensors"), kw.get("dstRank", kw.get("srcRank", -1)), kw.get("tag", 0)]
            tensors, peer, tag = (list(args) + rest[len(args):])[:3]
            ring = _P2P.get(id(self)) or _P2P.setdefault(id(self), _Ring())
            ring.count += 1
            ring.last.append([
                ring.count, op, int(peer), int(tag),
                sum(t.numel() * t.element_size() for t in tensors),
                str(tensors[0].dtype).rpartition(".")[2] if tensors else "", at,
                weakref.ref(work) if work is not None else None])
        except Exception:
            pass
        return work

    p2p.__doc__, p2p.__name__ = call.__doc__, call.__name__
    return p2p


def _done(entry: list[Any]) -> bool:
    work = entry[7]() if entry[7] is not None else None
    return work is None or bool(work.is_completed())


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
        colls = sorted((e for e in by_pg.get(str(name), ()) if not e.get("is_p2p")),
                       key=lambda e: e["collective_seq_id"])
        ring = _P2P.get(id(pg))
        p2p = list(ring.last) if ring is not None else []
        # pg_status is keyed by the recorder's own id of the group, which is this process's
        # count of groups it is in: not the name, which every process agrees on.
        mine = status.get(str(colls[-1].get("pg_id"))) if colls else None
        if me not in members or not (mine or p2p):
            continue
        # The status counts what completed in gloo's op ids (every operation, point-to-point
        # ones too: gloo numbers them all) and in collective numbers elsewhere (NCCL).
        unit = "op_id" if str(dist.get_backend(pg)) == "gloo" else "collective_seq_id"
        group = _merged(colls, int((mine or {}).get("last_completed_collective", 0)), unit,
                        p2p, ring.count if ring is not None else 0)
        if group is None:
            continue
        at_ns = group.pop("at_ns")
        groups.append({
            "label": _label(pg, name, len(members), c10d), "group_rank": members[me],
            "group_size": len(members), **group,
            "entered_at": mono - max(0, now_ns - at_ns) / 1e9})
    # gloo blocks while it waits; NCCL's host side spins in CUDA's synchronisation instead,
    # so its CPU use tells nothing of progress (`launcher.hang.watch`).
    spins = any(str(dist.get_backend(pg)) != "gloo" for pg in list(c10d._world.pg_names))
    return {"pid": os.getpid(), "rank": me, "groups": groups, "spins": spins}


def _merged(colls: list[dict[str, Any]], completed: int, unit: str, p2p: list[list[Any]],
            p2p_count: int) -> dict[str, Any] | None:
    """One group's operations, collectives and point-to-point, in the order they were entered:
    its sequence numbers (every operation counted), what is in flight, the last `_HISTORY`."""
    import bisect

    coll_at = [int(e["time_created_ns"]) for e in colls]
    p2p_at = [int(e[6]) for e in p2p]
    first_p2p = p2p[0][0] - 1 if p2p else p2p_count

    def p2p_before(at: int) -> int:
        i = bisect.bisect_left(p2p_at, at)
        return p2p[i - 1][0] if i else min(first_p2p, p2p_count)

    def colls_before(at: int) -> int:
        i = bisect.bisect_right(coll_at, at)
        return int(colls[i - 1]["collective_seq_id"]) if i else \
            (int(colls[0]["collective_seq_id"]) - 1 if colls else 0)

    rows = []   # (entered ns, seq, op, peer, collectives so far, in flight, dtype, nbytes, p2p)
    for e in colls[-_HISTORY:]:
        n = int(e["collective_seq_id"])
        dtype, size = _DTYPES.get((e.get("input_dtypes") or [""])[0], ("", 0))
        rows.append((int(e["time_created_ns"]), n + p2p_before(int(e["time_created_ns"])),
                     _op(e), -1, n, int(e.get(unit, n)) > completed, dtype,
                     sum(_numel(s) for s in e.get("input_sizes") or ()) * size, 0))
    for p in p2p:
        rows.append((p[6], p[0] + colls_before(p[6]), p[1], p[2], colls_before(p[6]),
                     not _done(p), p[5], p[4], 1 if p[1] == "send" else 2))
    if not rows:
        return None
    rows = sorted(rows, key=lambda r: (r[0], r[1]))[-_HISTORY:]
    seq = max(r[1] for r in rows)
    flying = [r for r in rows if r[5]]
    now = rows[-1] if rows[-1][5] or not flying else flying[0]
    return {"seq": seq, "done": flying[0][1] - 1 if flying else seq, "op": now[2],
            "dtype": now[6], "p2p": now[8], "peer": now[3], "nbytes": now[7], "at_ns": now[0],
            "history": [[r[1], r[2], r[3], r[4]] for r in rows]}


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
