"""Rank program of the checkpoint bench: save, or resume, a run of the trainer it imports.

    python checkpoint_rank.py save|load OUT_DIR TRAINER_FLAGS...

It imports ``trainer`` from ``PYTHONPATH`` (the checkout being measured: this one, or an older
tree exported by `bench.checkpoint` to measure the format it wrote) and uses only what every
version since the mesh has: ``parse_args``, ``resolve_dp``, ``mesh_for``, ``build_run``,
``train_step`` and ``trainer.train.save_checkpoint``.

``save``: build the run, take one step (so AdamW has its moments), then save REPS times (the
``REPS`` environment variable), each timed from a barrier; the bytes a rank passed to
``write()`` during a save come from ``/proc/self/io`` (``wchar``). ``load``: build the run with
``--resume``, the loading itself (the trainer's ``restore``) timed and watched: a thread samples
the rank's resident anonymous and file-mapped memory every millisecond, and the peak above what
the rank held when the load began is its extra memory (which includes the optimizer state the
load creates: AdamW has none before its first step, so the rank also reports its size). Each
rank writes ``rank<r>.json``.
"""

import json
import os
import sys
import threading
import time
from pathlib import Path


def _status() -> dict[str, int]:
    """RssAnon and RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _written() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


class Watch:
    """The peak of RssAnon and of RssAnon + RssFile while it runs, sampled every millisecond."""

    def __init__(self) -> None:
        self.start = _status()
        self.peak_anon, self.peak_total = 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while True:
            now = _status()
            self.peak_anon = max(self.peak_anon, now["RssAnon"])
            self.peak_total = max(self.peak_total, now["RssAnon"] + now["RssFile"])
            if self._stop.wait(0.001):
                return

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        start = self.start
        return {"extra_anon": self.peak_anon - start["RssAnon"],
                "extra_total": self.peak_total - start["RssAnon"] - start["RssFile"]}


def _held_bytes(run: object) -> tuple[int, int]:
    """Bytes of this rank's own shard: parameters, main weights and optimizer state; and of
    the optimizer state alone (AdamW creates it at the first step, or a load creates it)."""
    import torch

    def size(tensors: list) -> int:
        unique = {id(t): t for t in tensors}
        return sum(t.numel() * t.element_size() for t in unique.values())

    state = [v for s in run.weights.optimizer.state.values()  # type: ignore[attr-defined]
             for v in s.values() if isinstance(v, torch.Tensor)]
    return size([*run.model.parameters(), *run.weights.values(), *state]), \
        size(state)  # type: ignore[attr-defined]


def main() -> None:
    phase, out, flags = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    import trainer.training.run as run_module
    from trainer.comm.bootstrap import init
    from trainer.config.options import parse_args, resolve_dp
    try:
        from trainer.training.checkpointing import save_checkpoint
    except ImportError:  # the format-2 trainer of the "before" checkout kept it here
        from trainer.train import save_checkpoint  # type: ignore[attr-defined,no-redef]
    from trainer.training.step import train_step

    world = init(backend="mpi")
    cfg = resolve_dp(parse_args(flags, quiet=True), world.size)
    result: dict = {"rank": world.rank}
    if phase == "load":
        restore = run_module.restore

        def watched(*args: object, **kwargs: object) -> object:
            watch, start = Watch(), time.perf_counter()
            try:
                return restore(*args, **kwargs)
            finally:
                result["load_s"] = time.perf_counter() - start
                result.update(watch.stop())

        run_module.restore = watched
    run = run_module.build_run(cfg, run_module.mesh_for(cfg, world))
    result["held_bytes"], result["state_bytes"] = _held_bytes(run)
    if phase == "save":
        train_step(run, 1)
        saves = []
        for rep in range(int(os.environ.get("REPS", "1"))):
            world.comm.barrier()
            written, start = _written(), time.perf_counter()
            save_checkpoint(run, 2 + rep)
            saves.append({"s": time.perf_counter() - start, "bytes": _written() - written})
        result["saves"] = saves
    (out / f"rank{world.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
