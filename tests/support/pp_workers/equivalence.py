"""One pipeline rank of the runtime tests; returns what it saw (`tests.support.mpi_runs`).

    mpiexec -n P python -m tests.support.mpi_worker tests.support.pp_workers.equivalence:run OUT

For every case of `CASES` (schedule, m, v, group) it builds the schedule, runs this rank's list
with `trainer.parallel.pipeline.runtime.run_schedule` on `LinearStages` over the MPI world
communicator,
and records the losses (last rank), the gradients of its stages, the peak in-flight count and
bytes, the static checker's prediction, and every rank's gathered timeline. Then it probes
`agree_on_spec` with shapes that differ between ranks. Rank 0 also writes a Chrome trace and a
Gantt PNG of the first case. Any unexpected exception aborts every rank, so the test sees a
failure instead of a hang.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tests.support.pp_workers.stages import DTYPE, ROWS, WIDTH, LinearStages
from trainer.comm.bootstrap import init
from trainer.comm.protocol import Communicator
from trainer.parallel.pipeline.check import check_schedule
from trainer.parallel.pipeline.runtime import P2PSpec, agree_on_spec, run_schedule
from trainer.parallel.pipeline.schedule import ScheduleError, build, chunks_of
from trainer.parallel.pipeline.timeline import Event, gather, write_chrome_trace, write_gantt

# (schedule, m, v, group) per pipeline size; group=None is Megatron's default (p)
CASES: dict[int, list[tuple[str, int, int, int | None]]] = {
    2: [("gpipe", 4, 1, None), ("1f1b", 1, 1, None), ("1f1b", 5, 1, None),
        ("interleaved", 4, 2, None), ("interleaved", 6, 2, 3)],
    4: [("gpipe", 6, 1, None), ("1f1b", 3, 1, None), ("1f1b", 8, 1, None),
        ("interleaved", 8, 2, None), ("interleaved", 10, 2, 5), ("interleaved", 4, 3, None)],
}
SPEC = P2PSpec((ROWS, WIDTH), DTYPE)


def case_name(case: tuple[str, int, int, int | None]) -> str:
    name, m, v, group = case
    return f"{name}-m{m}-v{v}" + (f"-g{group}" if group else "")


def run_case(comm: Communicator, case: tuple[str, int, int, int | None]) -> dict[str, Any]:
    name, m, v, group = case
    p, v = comm.size, chunks_of(name, v)
    schedule = build(name, p, m, v, group)
    predicted = check_schedule(schedule, p, v, m=m).max_in_flight[comm.rank]
    stage = LinearStages(p, v, comm.rank, m)
    result = run_schedule(schedule[comm.rank], stage, comm, SPEC, v=v, clock=time.monotonic,
                          t0=common_start(comm))
    events = gather(comm, result.timeline)
    return {"losses": {mb: t.item() for (mb, _), t in result.outputs.items()},
            "grads": stage.grads(), "max_in_flight": result.max_in_flight,
            "predicted_in_flight": predicted, "peak_bytes": result.peak_activation_bytes,
            "events": [asdict(e) for e in events], "left_saved": len(stage.saved)}


def common_start(comm: Communicator) -> float:
    """Rank 0's monotonic clock after a barrier, on every rank: processes on one host share
    CLOCK_MONOTONIC, so events of different ranks compare exactly (causality test)."""
    comm.barrier()
    t0 = torch.tensor([time.monotonic()], dtype=torch.float64)
    comm.broadcast(t0, 0)
    return float(t0)


def probe_disagreement(comm: Communicator) -> str:
    try:
        agree_on_spec(comm, P2PSpec((ROWS, WIDTH + comm.rank), DTYPE))
    except ScheduleError as exc:
        return str(exc)
    return "no error"


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    comm = world.comm
    agree_on_spec(comm, SPEC)
    result: dict[str, Any] = {"rank": comm.rank}
    for case in CASES[comm.size]:
        result[case_name(case)] = run_case(comm, case)
    result["disagreement"] = probe_disagreement(comm)
    if comm.rank == 0:
        first = case_name(CASES[comm.size][0])
        events = [Event(**e) for e in result[first]["events"]]
        write_chrome_trace(out / "trace.json", events, title=first)
        write_gantt(out / "gantt.png", events, title=first)
    return result
