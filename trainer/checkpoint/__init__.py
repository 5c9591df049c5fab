"""Atomic, verified checkpoints: save every N steps, keep the last K, resume the newest.

Layout of one checkpoint (``<run_dir>/checkpoints/step-<N>/``):

    model-tp00-pp00.pt   model state_dict of the (tp, pp) shard, one file per model shard
    optim-tp00-pp00.pt   optimizer state_dict of that shard (none under ZeRO-1: instead
                         zero-tp00-pp00-index.pt and one zero-tp00-pp00-dpRRR.pt per DP rank,
                         `trainer.zero.state`)
    rng.pt               torch (CPU and CUDA) and Python ``random`` states of the leading rank
    meta.json            step, data position, full config, model config, parallel layout
    COMMITTED            the commit record, written last: size and sha256 of every file above;
                         a folder without it is not a checkpoint

Under data parallelism every DP rank holds the same state, so only DP rank 0 writes (under
ZeRO-1 every rank writes its optimizer shard besides, all ranks being the writers). A model
split over tensor or pipeline parallelism is written by the ranks of DP replica 0 together
(``writers``), each its own ``model``/``optim`` shard into one shared temporary folder; the
group agrees that every shard is on disk and gathers their checksums before its rank 0 commits.

Crash safety (`save`): files are written into ``step-<N>.tmp-<random>/`` and fsynced, the
folder is renamed to ``step-<N>/`` and the parent fsynced, then ``COMMITTED`` is written and
fsynced. `latest` only returns folders with the marker, so a kill at any point leaves the
previous checkpoint as the resume point. `prune` deletes a folder's marker before its files,
and deletes leftovers of dead saves (temporaries, folders without a marker). Every point is
exercised by the kill hook of `trainer.checkpoint.fault`.

The run dir (`run_dir`): checked before a run is built; a new run never mixes with the
checkpoints of another (refused, or with ``--overwrite`` moved aside first).

Agreement (`verdict`): every rank judges the checkpoint it reads; the ranks agree on the worst
verdict collectively and the lowest rank holding it reports it, once.

Integrity (`load`): every file a rank reads is checked against the commit record
(size, then sha256) before it is parsed; a mismatch raises `CheckpointDamaged` naming the file.
"""

from trainer.checkpoint.fault import FAULT_ENV, POINTS
from trainer.checkpoint.layout import (
    DAMAGED_SUFFIX,
    FORMAT_VERSION,
    MARKER,
    CheckpointDamaged,
    CheckpointError,
    latest,
    shard_name,
    step_dirs,
)
from trainer.checkpoint.load import Checkpoint, check_compatible, load, read_meta, restore_rng
from trainer.checkpoint.save import save

__all__ = [
    "DAMAGED_SUFFIX", "FAULT_ENV", "FORMAT_VERSION", "MARKER", "POINTS", "Checkpoint",
    "CheckpointDamaged", "CheckpointError", "check_compatible", "latest", "load", "read_meta",
    "restore_rng", "save", "shard_name", "step_dirs",
]
