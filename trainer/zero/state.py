"""ZeRO-1 checkpoints: every DP rank writes its own shard; a resume at any dp re-shards.

Per (tp, pp) stage a ``--zero 1`` checkpoint holds, besides the model file of DP rank 0
(``model-tpXX-ppYY.pt``, the parameters, replicated over DP; bf16 under ``--precision bf16``):

    zero-tp00-pp00-index.pt   written by DP rank 0: the flat layout (`trainer.zero.reshard`:
                              dp, padded length, buckets, each rank's shard ranges, every
                              parameter's name, shape and offset), AdamW's step count and
                              hyperparameters, the kinds of state saved
    zero-tp00-pp00-dp000.pt   written by DP rank r: its shard of every bucket, concatenated in
                              bucket order, one flat tensor per kind: ``main`` (the fp32 main
                              weights, bf16 runs only), ``exp_avg``, ``exp_avg_sq``

There is no ``optim`` file: no rank gathers the optimizer state, at save or at load. On
``--resume`` (`load_shards`) each rank reads its stage's index, asks `reshard.plan_reads` which
saved files hold its pieces, and opens only those (at the same dp: its own file; at another dp
the one or two files that overlap its range), one at a time, keeping just its pieces. Then the
parameters are all-gathered from the restored main pieces (`ZeroOptimizer.publish`). At the
same dp every piece gets back exactly the values it had: the resume is bit-exact. A checkpoint
of another model or tp/pp is refused (`trainer.checkpoint.check_compatible`, and here again
by the index's names and shapes). A ``--zero 0`` checkpoint resumes under ``--zero 1`` too
(its whole optimizer file is read and sliced, `ZeroOptimizer`); the reverse is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainer.checkpoint import Checkpoint, CheckpointError
from trainer.checkpoint.load import load_file
from trainer.checkpoint.verdict import agree, quiet
from trainer.comm.protocol import Communicator, ReduceOp
from trainer.zero.optimizer import ZeroOptimizer
from trainer.zero.reshard import FlatIndex, layout_differences, plan_reads

_MOMENTS = ("exp_avg", "exp_avg_sq")
#: The AdamW settings a resume takes from the checkpoint, as torch's load_state_dict does (the
#: kernel choice, foreach or fused, stays the resuming device's).
_HYPER = ("lr", "betas", "eps", "weight_decay")


def index_name(tp: int, pp: int) -> str:
    return f"zero-tp{tp:02d}-pp{pp:02d}-index.pt"


def shard_name(tp: int, pp: int, dp_rank: int) -> str:
    return f"zero-tp{tp:02d}-pp{pp:02d}-dp{dp_rank:03d}.pt"


@dataclass(frozen=True)
class ShardReads:
    """What `load_shards` read: the shard files it opened (besides the index) and their bytes."""

    files: tuple[str, ...]
    bytes: int


def flat_index(zero: ZeroOptimizer) -> FlatIndex:
    """This run's flat layout, parameters named as in the model's state dict."""
    name_of = {id(p): n for n, p in zero.model.named_parameters()}
    return FlatIndex.of(zero.layout, [name_of[id(p)] for p in zero.params],
                        [tuple(p.shape) for p in zero.params])


@torch.no_grad()
def shard_files(zero: ZeroOptimizer, tp: int, pp: int) -> dict[str, Any]:
    """The files this DP rank writes, by name (collective over DP: the step count)."""
    step = _steps_taken(zero)
    kinds = (["main"] if zero.dtype is not None else []) + (list(_MOMENTS) if step else [])
    index, rank = flat_index(zero), zero.sync.comm.rank
    files: dict[str, Any] = {shard_name(tp, pp, rank): {
        "dp": index.dp, "rank": rank, "ranges": index.ranges(rank),
        **{kind: _flat(zero, kind) for kind in kinds}}}
    if rank == 0:
        hyper = [{k: g[k] for k in _HYPER if k in g} for g in zero.optimizer.param_groups]
        files[index_name(tp, pp)] = {**index.to_dict(), "step": step, "kinds": kinds,
                                     "hyper": hyper}
    return files


def _flat(zero: ZeroOptimizer, kind: str) -> torch.Tensor:
    """``kind`` of this rank's pieces laid out as its shards of the buckets, concatenated."""
    dtype = torch.float32 if zero.dtype is not None else zero.params[0].dtype  # the pieces'
    widths = [(b.end - b.start) // zero.layout.dp for b in zero.layout.buckets]
    before = [sum(widths[:k]) for k in range(len(widths))]
    out = torch.zeros(sum(widths), dtype=dtype, device=zero.sync.buffer.device)
    for main, piece in zip(zero.main, zero.pieces, strict=True):
        value = main.detach() if kind == "main" else zero.optimizer.state[main][kind]
        at = before[piece.bucket] + piece.at
        out[at:at + main.numel()].copy_(value.view(-1))
    return out


def _steps_taken(zero: ZeroOptimizer) -> int:
    """AdamW's step count (a rank whose shards hold only padding has no state of its own)."""
    mine = max((int(s["step"]) for s in zero.optimizer.state.values() if "step" in s),
               default=0)
    count = torch.tensor([mine], dtype=torch.int64, device=zero.sync.buffer.device)
    if zero.sync.comm.size > 1:
        zero.sync.comm.all_reduce(count, ReduceOp.MAX)
    return int(count)


@torch.no_grad()
def load_shards(zero: ZeroOptimizer, ckpt: Checkpoint, tp: int, pp: int) -> ShardReads:
    """Put this rank's pieces of the saved optimizer state into ``zero`` (reading the index
    and only the shard files that hold them), keeping the saved hyperparameters. The caller
    then publishes (all-gathers) the restored main pieces into the parameters."""
    device = zero.sync.buffer.device
    name = index_name(tp, pp)
    saved = load_file(ckpt.path, name, ckpt.record, device)
    index = FlatIndex.from_dict(saved)
    mine = flat_index(zero)
    diffs = layout_differences(index, mine.names, mine.shapes)
    if diffs:
        raise CheckpointError(
            "checkpoint does not match this run", str(ckpt.path / name),
            f"its ZeRO-1 shards hold other parameters ({len(diffs)} differ): "
            + "; ".join(diffs[:4]),
            "Resume with the checkpoint's model and --tp/--pp, or use a new --run-dir")
    if len(saved["hyper"]) != len(zero.optimizer.param_groups):
        raise CheckpointError(
            "checkpoint does not match this run", str(ckpt.path / name),
            f"it has {len(saved['hyper'])} optimizer groups, this run "
            f"{len(zero.optimizer.param_groups)}",
            "Resume with the dtrain that wrote it, or use a new --run-dir")
    got, reads = _read_pieces(zero, ckpt, index, mine.names, saved["kinds"], tp, pp)
    _install(zero, got, int(saved["step"]), saved["hyper"])
    return reads


def _read_pieces(zero: ZeroOptimizer, ckpt: Checkpoint, index: FlatIndex,
                 names: Sequence[str], kinds: Sequence[str], tp: int,
                 pp: int) -> tuple[dict[str, list[torch.Tensor]], ShardReads]:
    """Every saved ``kind`` of this rank's pieces, the saved files read one at a time."""
    wanted = [(names[p.param], p.lo, p.hi) for p in zero.pieces]
    got = {kind: [torch.empty(hi - lo, dtype=m.dtype, device=m.device)
                  for (_, lo, hi), m in zip(wanted, zero.main, strict=True)] for kind in kinds}
    reads = plan_reads(index, wanted)
    opened = sorted({r.rank for r in reads})
    for rank in opened:
        data = load_file(ckpt.path, shard_name(tp, pp, rank), ckpt.record,
                         zero.sync.buffer.device)
        for r in (r for r in reads if r.rank == rank):
            for kind in kinds:
                got[kind][r.piece][r.dst:r.dst + r.n].copy_(data[kind][r.src:r.src + r.n])
        del data  # one saved shard held at a time
    files = tuple(shard_name(tp, pp, rank) for rank in opened)
    return got, ShardReads(files, sum(ckpt.record[f].size for f in files))


def _install(zero: ZeroOptimizer, got: dict[str, list[torch.Tensor]], step: int,
             hyper: Sequence[dict[str, Any]]) -> None:
    # torch keeps ``step`` as an fp32 tensor, fp64 when that is the default dtype
    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for n, main in enumerate(zero.main):
        if "main" in got:  # under fp32 a view of the parameter: its piece is restored too
            main.copy_(got["main"][n].view_as(main))
        if step:
            zero.optimizer.state[main] = {
                "step": torch.tensor(float(step), dtype=step_dtype),
                **{m: got[m][n].view_as(main).clone() for m in _MOMENTS}}
    for group, saved in zip(zero.optimizer.param_groups, hyper, strict=True):
        group.update(saved)


def resume_shards(zero: ZeroOptimizer, ckpt: Checkpoint, shard: tuple[int, ...],
                  deciders: Sequence[Communicator], device: torch.device) -> ShardReads:
    """`load_shards` on every rank, then the all-gather of the restored parameters. A refusal
    or a damaged file on any rank stops every rank together, reported once (no rank is left
    waiting in the all-gather). What was read is kept in ``zero.restored``."""
    reads, error = None, None
    try:
        reads = load_shards(zero, ckpt, *shard[:2])
    except CheckpointError as exc:
        error = exc
    worst, reporter = agree(error, deciders, device)
    if worst or reads is None:
        raise (error if reporter and error is not None else quiet(ckpt.path)
               ).everywhere(report=reporter)
    zero.publish()
    zero.restored = reads
    return reads
