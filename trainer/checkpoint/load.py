"""Reading a committed checkpoint: every file verified against the commit record first."""

from __future__ import annotations

import json
import pickle
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.files import FileRecord, verify_file
from trainer.checkpoint.layout import (
    FALLBACK_HINT,
    FORMAT_VERSION,
    MARKER,
    STEP_DIR,
    CheckpointDamaged,
    CheckpointError,
    shard_name,
)

_SHA256 = re.compile(r"[0-9a-f]{64}")
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")  # what torch's weights_only unpickler refused

#: Layout keys whose change makes a checkpoint unusable (model state is sharded along them; a
#: ``ppNN`` shard holds the layers its stages had). dp is not one: DP state is replicated and
#: the data position is the step, whatever dp is.
SHARDED_AXES = ("tp", "pp", "ep", "virtual_stages", "stage_layers")


@dataclass(frozen=True)
class Checkpoint:
    """What ``load`` returns: the state to put back, and where it came from."""

    path: Path
    step: int
    meta: dict[str, Any]
    model: dict[str, torch.Tensor]
    optim: dict[str, Any] | None
    """None: the optimizer state is in ZeRO-1 shard files (`trainer.zero.checkpoint`)."""
    rng: dict[str, Any]
    record: dict[str, FileRecord] = field(default_factory=dict)
    """The commit record, to verify the files read later (`load_file`)."""


def read_record(path: Path) -> dict[str, FileRecord]:
    """The commit record of a checkpoint folder: each file's size and sha256. A record that
    does not describe a checkpoint of this format is damage (a resume may skip it), except one
    of format 1 (no checksums) or of a newer format, which are refused."""
    if not (path / MARKER).is_file():
        raise CheckpointError("not a committed checkpoint", str(path),
                              f"the folder has no {MARKER} marker (the save did not finish)",
                              "Resume from an older step-<N> folder, or let --resume pick one")

    def damaged(why: str) -> CheckpointDamaged:
        return CheckpointDamaged(f"checkpoint {path} is damaged", f"file {MARKER}", why,
                                 FALLBACK_HINT)

    try:
        body = json.loads((path / MARKER).read_bytes())
    except (OSError, ValueError) as exc:
        raise damaged(f"the commit record cannot be parsed ({exc})") from None
    if isinstance(body, dict) and body.keys() == {"step"}:
        raise CheckpointError(
            "checkpoint has no checksums", str(path / MARKER),
            f"it is format 1, this dtrain reads format {FORMAT_VERSION} (a commit record "
            "listing each file's sha256)",
            "Resume it with the dtrain that wrote it, or start a new --run-dir")
    version = body.get("format") if isinstance(body, dict) else None
    if type(version) is int and version > FORMAT_VERSION:
        raise CheckpointError(
            "checkpoint of another format", str(path / MARKER),
            f"its commit record says format {version}, this dtrain reads format "
            f"{FORMAT_VERSION}: a newer dtrain wrote it, or a bit of the record flipped",
            f"Resume it with the dtrain that wrote it; if this one did, move {path.name} out "
            "of the checkpoints folder and --resume again")
    problem = _record_problem(body, path)
    if problem:
        raise damaged(f"the commit record does not describe a checkpoint: {problem}")
    return {name: FileRecord(f["size"], f["sha256"]) for name, f in body["files"].items()}


def _record_problem(body: Any, path: Path) -> str:
    """What makes ``body`` not a format-2 commit record of ``path`` ("" when it is one)."""
    if not isinstance(body, dict):
        return f"it is a JSON {type(body).__name__}, not an object"
    if body.keys() != {"format", "step", "files"}:
        return (f"its keys are {', '.join(map(repr, sorted(body)))}, not 'files', 'format', "
                "'step'")
    if body["format"] != FORMAT_VERSION:
        return f"its format is {body['format']!r}"
    folder = STEP_DIR.match(path.name)
    if type(body["step"]) is not int or (folder and int(folder.group(1)) != body["step"]):
        return f"its step {body['step']!r} is not the folder's"
    files = body["files"]
    if not isinstance(files, dict) or not {"meta.json", "rng.pt"} <= files.keys():
        return "its file list lacks meta.json or rng.pt"
    for name, entry in files.items():
        if not (isinstance(entry, dict) and entry.keys() == {"size", "sha256"}
                and type(entry["size"]) is int and entry["size"] >= 0
                and isinstance(entry["sha256"], str) and _SHA256.fullmatch(entry["sha256"])):
            return f"its entry for {name!r} is not a size and a sha256"
    return ""


def read_meta(path: Path) -> tuple[dict[str, FileRecord], dict[str, Any]]:
    """The commit record and the verified ``meta.json`` of a checkpoint folder: enough to tell
    whether it fits a run before any shard is read (`check_compatible`)."""
    record = read_record(path)
    meta = json.loads(verify_file(path, "meta.json", record).read_bytes())
    return record, meta


def optim_sharded(record: dict[str, FileRecord], shard: tuple[int, ...]) -> bool:
    """The optimizer state is in ZeRO-1 shards: no ``optim`` file of ``shard``, ``zero`` ones."""
    return shard_name("optim", *shard) not in record and any(n.startswith("zero-")
                                                             for n in record)


def load(path: Path, *, map_location: str | torch.device = "cpu",
         shard: tuple[int, ...] = (0, 0),
         read: tuple[dict[str, FileRecord], dict[str, Any]] | None = None) -> Checkpoint:
    """Read a committed checkpoint folder: meta, RNG and the (tp, pp) ``shard``, each file
    verified against the commit record before it is parsed (``read``: what `read_meta`
    returned, when the caller has it already). A checkpoint whose optimizer state is sharded
    (ZeRO-1: the record lists no ``optim`` file but ``zero`` files) has none."""
    record, meta = read or read_meta(path)
    model, rng = (load_file(path, name, record, map_location) for name in
                  (shard_name("model", *shard), "rng.pt"))
    optim = None if optim_sharded(record, shard) else \
        load_file(path, shard_name("optim", *shard), record, map_location)
    return Checkpoint(path, int(meta["step"]), meta, model, optim, rng, record)


def load_file(path: Path, name: str, record: dict[str, FileRecord],
              map_location: str | torch.device = "cpu") -> Any:
    """``path/name``, verified against ``record`` (`verify_file`), then unpickled with
    ``weights_only=True`` given explicitly: tensors and plain containers only, whatever
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says (it only overrides a call that passes nothing),
    so no code in a checkpoint ever runs."""
    try:
        return torch.load(verify_file(path, name, record), map_location=map_location,
                          weights_only=True)
    except pickle.UnpicklingError as exc:  # weights_only refused a global: code, not data
        wants = _GLOBAL.search(str(exc))
        raise CheckpointError(
            "checkpoint file is not plain tensor data", f"{path / name}",
            "unpickling it would " + (f"call {wants.group(1)}" if wants else "run code") +
            ": it may be hostile (its checksum matches, so whoever wrote it wrote the commit "
            "record too), and dtrain never runs code from a checkpoint",
            "Do not load it: restore the checkpoint from a copy you trust, or start a new "
            "--run-dir") from None
    except (OSError, ValueError, RuntimeError, EOFError) as exc:
        # The bytes are the ones saved: the reader, not the file, differs (e.g. torch version).
        raise CheckpointError("checkpoint unreadable", f"{path / name}",
                              f"{type(exc).__name__}: {exc}",
                              "Load it with the torch version that saved it") from exc


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def check_compatible(meta: dict[str, Any], *, model: dict[str, Any], layout: dict[str, int],
                     path: Path) -> None:
    """Refuse a checkpoint of another model config or sharded layout, listing every difference."""
    # A key absent on either side is not compared: checkpoints written before pipeline
    # parallelism have no stage keys (they were unsplit, and a pp difference still shows), and
    # those written before a model field existed (vocab_multiple) had its default.
    diffs = [f"{key}: checkpoint {meta['model'][key]!r}, now {value!r}"
             for key, value in model.items() if meta["model"].get(key, value) != value]
    diffs += [f"{key}: checkpoint {value!r}, unknown to this dtrain (a newer one wrote it)"
              for key, value in meta["model"].items() if key not in model]
    saved = meta["layout"]
    diffs += [f"{axis}: checkpoint {saved[axis]!r}, now {layout[axis]!r}"
              for axis in SHARDED_AXES
              if axis in saved and axis in layout and saved[axis] != layout[axis]]
    if diffs:
        raise CheckpointError("checkpoint does not match this run", str(path),
                              "differing fields: " + "; ".join(diffs),
                              "Resume with the checkpoint's settings, or use a new --run-dir")
