"""``python -m trainer.train`` in this process, watched or constrained
(`tests.trainer.test_checkpoint_async`).

    python -m tests.support.checkpoint_probe hold K OUT.json -- <train flags>
    python -m tests.support.checkpoint_probe no-pickle -- <train flags>

``hold K``: the background write of checkpoint K is held until step K + 2 has run (so training
must go on while it is in flight, or the hold times out); OUT.json gets the order in which
steps and the save's phases happened, and the main weights right after step K and after K + 2.

``no-pickle``: ``pickle.loads``, ``pickle.load``, ``pickle.Unpickler`` and ``torch.load`` raise
in this process before training starts: a resume must not need any of them. mpi4py's messages
between the ranks of the job (Python objects sent in memory, never a file) keep the functions
mpi4py was given (``MPI.pickle``), taken before the patch.
"""

from __future__ import annotations

import json
import pickle
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from trainer import train as trainer_train
from trainer.checkpoint.pieces import held
from trainer.checkpoint.save import Save

HOLD_S = 60.0  # far longer than steps of a tiny model take, even on a loaded machine


def hold(k: int, out: Path, argv: list[str]) -> int:
    events: list[str] = []
    ran_past = threading.Event()
    weights: dict[str, dict[str, list[float]]] = {}
    run_step, write, commit = trainer_train.run_step, Save.write, Save.commit

    def watched_step(run: Any, step: int) -> Any:
        events.append(f"step {step}")
        done = run_step(run, step)
        if step in (k, k + 2):
            weights[str(step)] = {h.placement.name: h.tensor.detach().reshape(-1).tolist()
                                  for h in held(run.weights.values(), run.weights.optimizer)}
        if step == k + 2:
            ran_past.set()
        return done

    def held_write(self: Save) -> None:
        if self.step == k and not ran_past.wait(HOLD_S):
            events.append("hold timed out")
        events.append(f"write {self.step}")
        write(self)

    def watched_commit(self: Save) -> None:
        commit(self)
        events.append(f"commit {self.step}")

    trainer_train.run_step = watched_step  # type: ignore[assignment]
    Save.write = held_write  # type: ignore[method-assign]
    Save.commit = watched_commit  # type: ignore[method-assign]
    code = trainer_train.main(argv)
    out.write_text(json.dumps({"events": events, "weights": weights}))
    return code


def refuse(*args: object, **kwargs: object) -> Any:
    raise RuntimeError("unpickling is not allowed in this process")


def no_pickle(argv: list[str]) -> int:
    from mpi4py import MPI

    MPI.pickle.__init__(pickle.dumps, pickle.loads)  # type: ignore[misc]
    pickle.loads = refuse  # type: ignore[assignment]
    pickle.load = refuse  # type: ignore[assignment]
    pickle.Unpickler = refuse  # type: ignore[assignment, misc]
    torch.load = refuse
    return trainer_train.main(argv)


def main(args: list[str]) -> int:
    split = args.index("--")
    head, argv = args[:split], args[split + 1:]
    if head[0] == "hold":
        return hold(int(head[1]), Path(head[2]), argv)
    return no_pickle(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
