"""Reading a committed checkpoint: the commit record, then every file verified against it before
it is parsed (JSON, or safetensors through `trainer.checkpoint.files.TensorFile`)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import checksum
from trainer.checkpoint.files import FileRecord, TensorFile, verify_file
from trainer.checkpoint.layout import (
    FALLBACK_HINT,
    FORMAT_VERSION,
    INDEX,
    MARKER,
    META,
    PLAIN_NAME,
    REQUIRED,
    RNG,
    STEP_DIR,
    CheckpointDamaged,
    CheckpointError,
)

#: Model fields a checkpoint may differ in: the vocabulary padding follows tp (its rows are
#: masked out, never trained), so another tp pads to another multiple.
LAYOUT_FIELDS = {"vocab_multiple"}
#: What the refusals of other formats say this dtrain reads.
_READS = "formats " + " and ".join(map(str, sorted(checksum.BY_FORMAT)))


def read_record(path: Path) -> dict[str, FileRecord]:
    """The commit record of a checkpoint folder: each file's size and checksum (sha256 in
    format 3, XXH3-128 from format 4: `trainer.checkpoint.checksum`). A record that does not
    describe a checkpoint of a format this dtrain reads is damage (a resume may skip it),
    except one of format 1 (no checksums), 2 (pickles) or a newer format, which are refused."""
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
            f"it is format 1, this dtrain reads {_READS} (a commit record "
            "listing each file's checksum)",
            "Resume it with the dtrain that wrote it, or start a new --run-dir")
    version = body.get("format") if isinstance(body, dict) else None
    if version == 2 and isinstance(body.get("files"), dict) and "rng.pt" in body["files"]:
        raise CheckpointError(
            "checkpoint of an earlier format", str(path / MARKER),
            "it is format 2, whose files are pickles, and this dtrain never unpickles a "
            f"checkpoint (a pickle can run code); it reads {_READS} "
            "(safetensors and JSON)", "Finish that run with the dtrain that wrote it, or start "
            "a new --run-dir")
    if type(version) is int and version > FORMAT_VERSION:
        raise CheckpointError(
            "checkpoint of another format", str(path / MARKER),
            f"its commit record says format {version}, this dtrain reads {_READS}: a newer "
            "dtrain wrote it, or a bit of the record flipped",
            f"Resume it with the dtrain that wrote it; if this one did, move {path.name} out "
            "of the checkpoints folder and --resume again")
    problem = _record_problem(body, path)
    if problem:
        raise damaged(f"the commit record does not describe a checkpoint: {problem}")
    algorithm = checksum.BY_FORMAT[body["format"]]
    return {name: FileRecord(f["size"], f[algorithm], algorithm)
            for name, f in body["files"].items()}


def _record_problem(body: Any, path: Path) -> str:
    """What makes ``body`` not a commit record of ``path`` ("" when it is one)."""
    if not isinstance(body, dict):
        return f"it is a JSON {type(body).__name__}, not an object"
    if body.keys() != {"format", "step", "files"}:
        return (f"its keys are {', '.join(map(repr, sorted(body)))}, not 'files', 'format', "
                "'step'")
    algorithm = checksum.BY_FORMAT.get(body["format"]) if type(body["format"]) is int else None
    if algorithm is None:
        return f"its format is {body['format']!r}"
    folder = STEP_DIR.match(path.name)
    if type(body["step"]) is not int or (folder and int(folder.group(1)) != body["step"]):
        return f"its step {body['step']!r} is not the folder's"
    files = body["files"]
    if not isinstance(files, dict) or not set(REQUIRED) <= files.keys():
        return f"its file list lacks one of {', '.join(REQUIRED)}"
    for name, entry in files.items():
        if not PLAIN_NAME.match(name):
            return (f"it names the file {name!r}, not a plain file name in the checkpoint "
                    "folder")
        if not (isinstance(entry, dict) and entry.keys() == {"size", algorithm}
                and type(entry["size"]) is int and entry["size"] >= 0
                and _hex(entry[algorithm], checksum.HEX_DIGITS[algorithm])):
            return f"its entry for {name!r} is not a size and a {algorithm}"
    return ""


def _hex(value: Any, digits: int) -> bool:
    return isinstance(value, str) and len(value) == digits and \
        all(c in "0123456789abcdef" for c in value)


def read_meta(path: Path) -> tuple[dict[str, FileRecord], dict[str, Any]]:
    """The commit record and the verified ``meta.json`` of a checkpoint folder: enough to tell
    whether it fits a run before any tensor is read (`check_compatible`)."""
    record = read_record(path)
    return record, _json(path, META, record)


def read_index(path: Path, record: dict[str, FileRecord]) -> dict[str, Any]:
    """The verified ``index.json``: what every tensor file holds."""
    index = _json(path, INDEX, record)
    if not isinstance(index, dict) or not isinstance(index.get("files"), dict):
        raise CheckpointDamaged(f"checkpoint {path} is damaged", f"file {INDEX}",
                                "it does not list the tensor files", FALLBACK_HINT)
    return index


def _json(path: Path, name: str, record: dict[str, FileRecord]) -> Any:
    try:
        return json.loads(verify_file(path, name, record).read_bytes())
    except ValueError as exc:  # the bytes are the ones saved: they were never JSON
        raise CheckpointError("checkpoint file is not JSON", str(path / name), str(exc),
                              "Restore the checkpoint from a copy, or start a new "
                              "--run-dir") from None


def restore_rng(path: Path, record: dict[str, FileRecord], meta: dict[str, Any]) -> None:
    """Put back the random states the leader saved: torch's (and CUDA's) from
    ``rng.safetensors``, Python's from ``meta.json``."""
    saved = TensorFile(path, RNG, record)
    torch.set_rng_state(saved.read("torch"))
    cuda = sorted(k for k in saved.keys() if k.startswith("cuda"))
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([saved.read(k) for k in cuda])
    version, internal, gauss = meta["python_rng"]
    random.setstate((version, tuple(internal), gauss))


def check_compatible(meta: dict[str, Any], *, model: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint of another model, listing every differing field. The layout may
    differ in every way: the checkpoint's tensors are cut to this run's placement on load."""
    saved = meta["model"]
    diffs = [f"{key}: checkpoint {saved[key]!r}, now {value!r}"
             for key, value in model.items()
             if key not in LAYOUT_FIELDS and saved.get(key, value) != value]
    diffs += [f"{key}: checkpoint {value!r}, unknown to this dtrain (a newer one wrote it)"
              for key, value in saved.items() if key not in model]
    if diffs:
        raise CheckpointError("checkpoint does not match this run", str(path),
                              "differing fields: " + "; ".join(diffs),
                              "Resume with the checkpoint's model, or use a new --run-dir")
