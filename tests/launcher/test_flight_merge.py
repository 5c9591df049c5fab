"""The flight shim's merge of the Flight Recorder's collectives with the send/recv it notes
itself (`launcher/agent/flight_shim/sitecustomize.py`, pure part): every operation counted in
entry order, collectives keeping their count, what is in flight."""

from __future__ import annotations

import importlib.util
import weakref
from typing import Any

from launcher.agent import flight


def _shim() -> Any:
    spec = importlib.util.spec_from_file_location("dtrain_flight_shim",
                                                  f"{flight.SHIM}/sitecustomize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # without DTRAIN_FLIGHT_FILE: defines, starts nothing
    return module


class Work:
    def __init__(self, completed: bool) -> None:
        self.completed = completed

    def is_completed(self) -> bool:
        return self.completed


def coll(seq: int, op_id: int, at: int) -> dict[str, Any]:
    return {"collective_seq_id": seq, "op_id": op_id, "time_created_ns": at,
            "profiling_name": "gloo:all_reduce", "input_dtypes": ["Float"],
            "input_sizes": [[256]]}


def test_a_send_between_collectives_is_numbered_in_entry_order_and_in_flight_until_done():
    shim = _shim()
    pending = Work(False)
    p2p = [[1, "send", 0, 0, 4 << 20, "float32", 150, None],            # its work is gone: done
           [2, "send", 0, 0, 4 << 20, "float32", 350, weakref.ref(pending)]]
    # gloo numbers every operation: the collectives are op ids 2 and 3, both completed.
    colls = [coll(1, 2, 200), coll(2, 3, 300)]
    merged = shim._merged(colls, 3, "op_id", p2p, 2)
    assert merged["history"] == [[1, "send", 0, 0], [2, "all_reduce", -1, 1],
                                 [3, "all_reduce", -1, 2], [4, "send", 0, 2]]
    assert (merged["seq"], merged["done"], merged["op"], merged["p2p"], merged["peer"]) == \
        (4, 3, "send", 1, 0)
    assert merged["nbytes"] == 4 << 20 and merged["at_ns"] == 350
    pending.completed = True
    assert shim._merged(colls, 3, "op_id", p2p, 2)["done"] == 4
    # The second all-reduce not completed (op id 3 > 2): in flight from there on.
    assert shim._merged(colls, 2, "op_id", p2p, 2)["done"] == 2

def test_a_collective_not_completed_is_in_flight_in_the_recorders_own_count():
    shim = _shim()
    merged = shim._merged([coll(1, 1, 100), coll(2, 2, 200)], 1, "collective_seq_id", [], 0)
    assert (merged["seq"], merged["done"], merged["op"], merged["nbytes"]) == \
        (2, 1, "all_reduce", 1024)
    assert shim._merged([], 0, "op_id", [], 0) is None


_THREADS = """
import sys, threading
print(sorted(t.name for t in threading.enumerate()), flush=True)
if sys.argv[1] == "torch":
    import torch.distributed
    print(sorted(t.name for t in threading.enumerate()), flush=True)
"""


def _rank_threads(tmp_path: Any, then: str) -> list[str]:
    """The thread names a Python rank of a dtrain job has at start and, if ``then`` is
    "torch", after it imports torch.distributed (the real shim, in a real interpreter)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, **flight.rank_env({}, str(tmp_path / "rank-0.progress"), 1.0),
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _THREADS, then], env=env, check=True,
                         capture_output=True, text=True, timeout=120)
    return out.stdout.splitlines()


def test_a_rank_that_never_imports_torch_distributed_has_no_reader_thread(tmp_path):
    # An MPI program's MPI_Init holds the GIL in C: a waiting thread would wake every 5 ms.
    assert _rank_threads(tmp_path, "mpi") == ["['MainThread']"]


def test_importing_torch_distributed_starts_the_reader_thread(tmp_path):
    assert _rank_threads(tmp_path, "torch") == ["['MainThread']",
                                                "['MainThread', 'dtrain-flight']"]
