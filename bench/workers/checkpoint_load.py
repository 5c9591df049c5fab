"""A rank for `bench.checkpoint_async`: the seconds to load a run's newest checkpoint.

    python checkpoint_load.py <python -m trainer.train flags, --run-dir of a finished run>

Builds the run three times, as ``python -m trainer.train`` does
(`trainer.training.run.build_run`): twice without ``--resume`` (the first warms up), then with
it; the difference between the last two is the load (verify, read, copy into
place). Rank 0 prints ``{"load_s": ...}``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `trainer`


def main() -> int:
    from trainer.config.options import resolve_dp
    from trainer.training import startup
    from trainer.training.run import build_run, mesh_for

    ready = startup.start([*sys.argv[1:], "--resume"])
    if isinstance(ready, int):
        return ready
    world, cfg, corpus = ready
    cfg = resolve_dp(cfg, world.size)
    seconds = []
    for resume in (False, False, True):  # the first build warms up (imports, allocator)
        fresh = replace(cfg, checkpoint=replace(cfg.checkpoint, resume=resume))
        world.comm.barrier()  # every rank starts the clock together
        began = time.perf_counter()
        build_run(fresh, mesh_for(fresh, world), corpus)
        seconds.append(time.perf_counter() - began)
    if world.rank == 0:
        print(json.dumps({"load_s": seconds[2] - seconds[1]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
