"""Atomic, self-describing checkpoints: save every N steps, keep the last K, resume the newest.

Layout of one checkpoint (``<run_dir>/checkpoints/step-<N>/``):

    model-tp00-pp00.pt   model state_dict of the (tp, pp) shard, one file per model shard
    optim-tp00-pp00.pt   optimizer state_dict of that shard
    rng.pt               torch (CPU and CUDA) and Python ``random`` states of the leading rank
    meta.json            step, data position, full config, model config, parallel layout
    COMMITTED            written last; a folder without it is not a checkpoint

Under data parallelism every DP rank holds the same state, so only DP rank 0 writes. A model
split over tensor parallelism is written by the ranks of DP rank 0's TP group together
(``writers``), each its own ``model-tpNN``/``optim-tpNN`` files into one shared temporary
folder; the group agrees that every shard is on disk before its rank 0 commits.

Crash safety: files are written into ``step-<N>.tmp-<random>/`` and fsynced, the folder is
renamed to ``step-<N>/`` and the parent fsynced, then ``COMMITTED`` is written and fsynced.
``latest()`` only returns folders with the marker, so a save killed at any point leaves the
previous checkpoint as the resume point. Pruning deletes a folder's marker before its files.

Fault hook for tests: ``DTRAIN_FAULT=ckpt_before_commit`` (SIGKILL after the files are written,
before the rename) or ``DTRAIN_FAULT=ckpt_before_marker`` (after the rename, before the marker);
append ``@<step>`` to fire only when saving that step.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.comm.protocol import Communicator, ReduceOp
from trainer.errors import TrainerError

FORMAT_VERSION = 1
MARKER = "COMMITTED"
FAULT_ENV = "DTRAIN_FAULT"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^step-(\d+)\.tmp-[0-9a-f]+$")
#: Layout keys whose change makes a checkpoint unusable (model state is sharded along them; a
#: ``ppNN`` shard holds the layers its stages had). dp is not one: DP state is replicated and
#: the data position is the step, whatever dp is.
SHARDED_AXES = ("tp", "pp", "virtual_stages", "stage_layers")


class CheckpointError(TrainerError):
    """A checkpoint cannot be written, read, or does not fit this run."""


@dataclass(frozen=True)
class Checkpoint:
    """What ``load`` returns: the state to put back, and where it came from."""

    path: Path
    step: int
    meta: dict[str, Any]
    model: dict[str, torch.Tensor]
    optim: dict[str, Any]
    rng: dict[str, Any]


def shard_name(kind: str, tp_rank: int = 0, pp_rank: int = 0) -> str:
    return f"{kind}-tp{tp_rank:02d}-pp{pp_rank:02d}.pt"


def step_dirs(root: Path) -> dict[int, Path]:
    """Committed checkpoints under ``root`` by step."""
    found = {}
    if root.is_dir():
        for child in root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / MARKER).is_file():
                found[int(match.group(1))] = child
    return found


def step_of(path: Path) -> int:
    """The step of a ``step-<N>`` folder."""
    match = _STEP_DIR.match(path.name)
    if not match:
        raise CheckpointError("not a checkpoint folder", str(path),
                              "its name is not step-<N>", "Pass a step-<N> folder")
    return int(match.group(1))


def latest(root: Path) -> Path | None:
    """The newest committed checkpoint, ignoring temporaries and uncommitted folders."""
    found = step_dirs(root)
    return found[max(found)] if found else None


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(root: Path, step: int, *, model: dict[str, torch.Tensor], optim: dict[str, Any],
         meta: dict[str, Any], keep: int = 0, shard: tuple[int, int] = (0, 0),
         writers: Communicator | None = None) -> Path:
    """Write checkpoint ``step`` atomically, then prune to the newest ``keep`` (0 = keep all).

    ``shard`` is this rank's (tp, pp) model shard. With ``writers`` (the group of ranks that
    hold the different shards, every one calling ``save``) the call is collective: rank 0 of
    the group names the temporary folder and commits it once every shard is written."""
    if writers is not None and writers.size > 1:
        return _save_together(root, step, model=model, optim=optim, meta=meta, keep=keep,
                              shard=shard, writers=writers)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    if (final / MARKER).is_file():
        return final  # the same step is already committed (e.g. resumed, then saved at the end)
    tmp = root / f"step-{step}.tmp-{secrets.token_hex(4)}"
    with _save_errors(tmp):
        tmp.mkdir()
        _write_shard(tmp, model, optim, shard)
        _commit(root, tmp, final, step, meta)
    prune(root, keep=keep, current=step)
    return final


def _save_together(root: Path, step: int, *, model: dict[str, torch.Tensor],
                   optim: dict[str, Any], meta: dict[str, Any], keep: int,
                   shard: tuple[int, int], writers: Communicator) -> Path:
    """`save` by a group: folder named by rank 0, shards written by all, commit by rank 0.
    Every phase ends with an agreement, so a failure on one rank fails every rank (no hang)."""
    final, leader = root / f"step-{step}", writers.rank == 0
    device = next((t.device for t in model.values()), torch.device("cpu"))
    token = torch.tensor([-1], dtype=torch.int64, device=device)
    if leader:
        root.mkdir(parents=True, exist_ok=True)
        if not (final / MARKER).is_file():
            token[0] = secrets.randbits(31)
    writers.broadcast(token, 0)
    if int(token) < 0:
        return final  # already committed: nobody writes
    tmp = root / f"step-{step}.tmp-{int(token):08x}"

    def create() -> None:
        if leader:
            tmp.mkdir()

    def commit() -> None:
        if leader:
            _commit(root, tmp, final, step, meta)

    for what, action in (("create the folder", create),
                         ("write its shard", lambda: _write_shard(tmp, model, optim, shard)),
                         ("commit", commit)):
        error = None
        try:
            with _save_errors(tmp):
                action()
        except CheckpointError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable state: the others wait
            error = CheckpointError("checkpoint save failed", str(tmp),
                                    f"{type(exc).__name__}: {exc}",
                                    "Save only tensors and plain Python values")
        failed = torch.tensor([int(error is not None)], dtype=torch.int64, device=device)
        writers.all_reduce(failed, ReduceOp.SUM)
        if error is not None:
            raise error
        if int(failed):
            raise CheckpointError("checkpoint save failed", str(tmp),
                                  f"{int(failed)} other writer(s) failed to {what}",
                                  "See their messages; check free space and permissions of "
                                  "--run-dir")
    if leader:
        prune(root, keep=keep, current=step)
    return final


@contextmanager
def _save_errors(tmp: Path) -> Iterator[None]:
    """OSError of a save becomes the CheckpointError users see."""
    try:
        yield
    except OSError as exc:
        raise CheckpointError("checkpoint save failed", str(tmp), exc.strerror or str(exc),
                              "Check free space and permissions of --run-dir") from exc


def _write_shard(tmp: Path, model: dict[str, torch.Tensor], optim: dict[str, Any],
                 shard: tuple[int, int]) -> None:
    _write_torch(tmp / shard_name("model", *shard), model)
    _write_torch(tmp / shard_name("optim", *shard), optim)


def _commit(root: Path, tmp: Path, final: Path, step: int, meta: dict[str, Any]) -> None:
    """RNG and meta into ``tmp``, rename it to ``final``, then the marker (the commit)."""
    _write_torch(tmp / "rng.pt", capture_rng())
    body = {"format": FORMAT_VERSION, "step": step, **meta}
    _write_bytes(tmp / "meta.json", json.dumps(body, indent=2, sort_keys=True).encode())
    _fsync_dir(tmp)
    _fault("ckpt_before_commit", step)
    if final.exists():
        _remove(final)  # an uncommitted leftover of a save that died after its rename
    tmp.rename(final)
    _fsync_dir(root)
    _fault("ckpt_before_marker", step)
    _write_bytes(final / MARKER, json.dumps({"step": step}).encode())
    _fsync_dir(final)


def prune(root: Path, *, keep: int, current: int) -> None:
    """Delete old committed checkpoints beyond ``keep`` and dead temporaries up to ``current``."""
    committed = step_dirs(root)
    if keep > 0:
        for step in sorted(committed)[:-keep]:
            _remove(committed[step])
    for child in root.iterdir():
        tmp = _TMP_DIR.match(child.name)
        bare = _STEP_DIR.match(child.name)
        dead = tmp or (bare and not (child / MARKER).exists())
        if dead and int(dead.group(1)) <= current:
            _remove(child)


def read_meta(path: Path) -> dict[str, Any]:
    """The meta.json of a committed checkpoint folder (to check it before loading shards)."""
    if not (path / MARKER).is_file():
        raise CheckpointError("not a committed checkpoint", str(path),
                              f"the folder has no {MARKER} marker (the save did not finish)",
                              "Resume from an older step-<N> folder, or let --resume pick one")
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError("checkpoint unreadable", str(path), str(exc),
                              "Delete this step folder to fall back to the previous one") from exc


def load(path: Path, *, map_location: str | torch.device = "cpu",
         shard: tuple[int, int] = (0, 0)) -> Checkpoint:
    """Read a committed checkpoint folder: meta, RNG and the (tp, pp) ``shard``."""
    meta = read_meta(path)
    try:
        model = torch.load(path / shard_name("model", *shard), map_location=map_location)
        optim = torch.load(path / shard_name("optim", *shard), map_location=map_location)
        rng = torch.load(path / "rng.pt")
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError("checkpoint unreadable", str(path), str(exc),
                              "Delete this step folder to fall back to the previous one") from exc
    return Checkpoint(path, int(meta["step"]), meta, model, optim, rng)


def check_compatible(meta: dict[str, Any], *, model: dict[str, Any], layout: dict[str, int],
                     path: Path) -> None:
    """Refuse a checkpoint of another model config or sharded layout, listing every difference."""
    diffs = [f"{key}: checkpoint {meta['model'].get(key)!r}, now {value!r}"
             for key, value in model.items() if meta["model"].get(key) != value]
    # A key absent on either side is not compared: checkpoints written before pipeline
    # parallelism have no stage keys (they were unsplit, and a pp difference still shows).
    saved = meta["layout"]
    diffs += [f"{axis}: checkpoint {saved[axis]!r}, now {layout[axis]!r}"
              for axis in SHARDED_AXES
              if axis in saved and axis in layout and saved[axis] != layout[axis]]
    if diffs:
        raise CheckpointError("checkpoint does not match this run", str(path),
                              "differing fields: " + "; ".join(diffs),
                              "Resume with the checkpoint's settings, or use a new --run-dir")


def _fault(name: str, step: int) -> None:
    """The documented test hook: die like a power cut at the named point of a save."""
    spec = os.environ.get(FAULT_ENV, "")
    point, _, at = spec.partition("@")
    if point == name and (not at or int(at) == step):
        os.kill(os.getpid(), signal.SIGKILL)


def _write_torch(path: Path, obj: Any) -> None:
    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    # The marker goes first: a crash half-way through deleting must not leave a folder that
    # looks committed but lacks files.
    marker = path / MARKER
    if marker.exists():
        marker.unlink()
        _fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)
