"""Atomic, verified checkpoints of safetensors and JSON: save every N steps, keep the last K,
resume the newest at any layout.

Layout of one checkpoint (``<run_dir>/checkpoints/step-<N>/``):

    rank-00003.safetensors  the slices global rank 3 is the writer of (`trainer.placement`:
                            one writer per slice, spread over the ranks that hold it), each
                            flat, under ``<kind>/<global name>``: ``param`` (the main weights,
                            fp32 whatever the model's precision), ``exp_avg``, ``exp_avg_sq``
    index.json              every tensor file's slices: kind, key, global name and shape, the
                            TP cut and the ZeRO-1 range (`trainer.checkpoint.pieces`)
    rng.safetensors         torch (CPU and CUDA) random states of the leading rank
    meta.json               step, data position, options, model, layout, AdamW's step count
                            and hyperparameters, Python's random state
    COMMITTED               the commit record, written last: size and checksum (XXH3-128;
                            sha256 in format 3, still read) of every file above; a folder
                            without it is not a checkpoint

No file is a pickle: loading never unpickles anything, whatever the environment says
(``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` included). A checkpoint of format 2 (pickled shards) is
refused with what to do. A resume reads at any layout: each rank plans which saved slices
overlap its own, opens only the files that hold them and reads only those ranges
(`pieces`). The trainer of recommenders saves its per-rank state the same way (`tree`).

Phases (`save`): ``start`` (collective, or none with a folder token agreed earlier: folder,
the leader's random state), ``write`` (each rank's tensor file, and its record left in the
folder), ``settle`` (collective: every write succeeded, the caller's checks agreed),
``commit`` (the leader, `commit`, once it has read every rank's record of its write:
`records`), ``finish`` (collective). `writer` runs the two local phases in a
background thread while training goes on (``--async-save``), at most one save in flight, the
ranks moving it on together by a late vote at step ends; `failure` makes a failed phase one
error on every rank and removes what it left.

Writing (`files`, `direct`): a tensor file is written with direct I/O from a page-aligned
staging block laid out as the file, or buffered where the filesystem refuses direct I/O; the
bytes and checksums are the same either way. A save's MB/s (`rate`) is over the seconds some
rank was writing, not from the first rank's start.

Crash safety (`commit`): files are written into ``step-<N>.tmp-<random>/`` and fsynced (those
of the leader's host by the leader, all at once) with the commit record (still
``.COMMITTED.tmp``) and the folder, the folder is renamed to ``step-<N>/``, the record renamed
to ``COMMITTED``, then both folders fsynced before anything is pruned. `latest` only returns
folders with the marker, so a kill at any point leaves the previous checkpoint as the resume
point. `prune` deletes a folder's marker before its files, and deletes leftovers of dead
saves (temporaries, folders without a marker). Every point is exercised by the kill hook of
`trainer.checkpoint.fault`.

The run dir (`run_dir`): checked before a run is built; a new run never mixes with the
checkpoints of another (refused, or with ``--overwrite`` moved aside first).

Agreement (`verdict`): every rank judges the checkpoint it reads; the ranks agree on the worst
verdict collectively and the lowest rank holding it reports it, once.

Integrity (`load`, `files`): every file a rank reads is checked against the commit record
(size, then checksum) before it is parsed; a mismatch raises `CheckpointDamaged` naming the file.
Names in the record and the index are plain names in the folder, only regular files are read,
never through a link, and every index entry is held to its tensor file's header and size before
anything is planned or allocated from it (`bounds`).
"""

from trainer.checkpoint.fault import FAULT_ENV, POINTS
from trainer.checkpoint.files import TensorFile
from trainer.checkpoint.layout import (
    DAMAGED_SUFFIX,
    FORMAT_VERSION,
    INDEX,
    MARKER,
    META,
    RNG,
    CheckpointDamaged,
    CheckpointError,
    latest,
    rank_file,
    step_dirs,
)
from trainer.checkpoint.load import (
    check_compatible,
    read_index,
    read_meta,
    read_record,
    restore_rng,
)
from trainer.checkpoint.save import save

__all__ = [
    "DAMAGED_SUFFIX", "FAULT_ENV", "FORMAT_VERSION", "INDEX", "MARKER", "META", "POINTS", "RNG",
    "CheckpointDamaged", "CheckpointError", "TensorFile", "check_compatible", "latest",
    "rank_file", "read_index", "read_meta", "read_record", "restore_rng", "save", "step_dirs",
]
