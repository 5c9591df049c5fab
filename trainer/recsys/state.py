"""Checkpoints of the recommender, through `trainer.checkpoint` (atomic, checksummed, pruned).

Every rank writes one tensor file, ``rank-RRRRR.safetensors`` (`trainer.checkpoint.rank_file`):
the rows (and the hash index) of its table shard, plus the replicated MLPs and the state of
both optimizers, flattened to tensors with a JSON skeleton in the index
(`trainer.checkpoint.tree`: nothing is pickled), so a rank reads its own file only. The ranks
write together (`trainer.checkpoint.save` over the world) and rank 0 commits. A resume loads
the newest committed checkpoint (rank 0 picks it; every rank verifies its files against the
commit record) and must run on the same number of ranks and the same model; the batch of a
step depends on (seed, step) only, so the continued run is bit-exact.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import torch

from trainer import checkpoint
from trainer.checkpoint import CheckpointDamaged, CheckpointError, tree, verdict
from trainer.checkpoint.layout import FALLBACK_HINT
from trainer.checkpoint.run_dir import folder, unusable
from trainer.comm.protocol import Communicator, ReduceOp
from trainer.recsys.config import OPTIONS, RecsysConfig
from trainer.recsys.model import DLRM
from trainer.schema import flatten
from trainer.sparse import SparseOptimizer


def save(cfg: RecsysConfig, step: int, model: DLRM, dense_opt: torch.optim.Optimizer,
         sparse_opt: SparseOptimizer) -> Path:
    comm = model.table.comm
    meta = {"config": flatten(cfg, OPTIONS), "model": _model_meta(cfg),
            "layout": {"shards": comm.size}}
    skeleton, tensors = tree.flatten({"model": _flat(model), "dense": dense_opt.state_dict(),
                                      "sparse": sparse_opt.state_dict()})
    return checkpoint.save(folder(Path(cfg.run_dir)), step, tensors=tensors,
                           contents=skeleton, meta=meta, keep=cfg.checkpoint.keep, world=comm,
                           device=comm_device(comm))


def resume(cfg: RecsysConfig, model: DLRM, dense_opt: torch.optim.Optimizer,
           sparse_opt: SparseOptimizer) -> int:
    """Load the newest checkpoint of ``--run-dir`` (collective); its step, 0 when none."""
    comm = model.table.comm
    root = folder(Path(cfg.run_dir))
    found = checkpoint.latest(root) if comm.rank == 0 else None
    step = _broadcast(comm, int(found.name.split("-")[1]) if found else 0)
    if step == 0:
        problem = unusable(root) if comm.rank == 0 else None
        if _any_failed(comm, problem is not None):  # checkpoint-like content it cannot use
            raise (problem or CheckpointError("checkpoint refused", str(root), "reported by "
                   "rank 0")).everywhere(report=comm.rank == 0)
        return 0
    error, state, path = None, None, root / f"step-{step}"
    try:
        state = _read(path, cfg, comm)
    except CheckpointError as exc:
        error = exc
    # Every rank's verdict, agreed: the ranks stop together and the lowest failing rank says
    # why, once (a checkpoint of another rank count is refused by all of them alike).
    worst, reporter = verdict.agree(error, comm, comm_device(comm))
    if worst != verdict.OK:
        raise (error or verdict.quiet(path)).everywhere(report=reporter)
    state = cast(dict[str, Any], state)  # read, or the agreement above raised
    model.dense.load_state_dict(_part(state["model"], "dense."))
    table = _part(state["model"], "table.")
    if model.table.hashed:
        table["index"] = _part(table, "index.")
    model.table.load_state_dict(table)
    dense_opt.load_state_dict(state["dense"])
    sparse_opt.load_state_dict(state["sparse"])
    return step


def _read(path: Path, cfg: RecsysConfig, comm: Communicator) -> dict[str, Any]:
    """This rank's state in checkpoint ``path`` (every file read is verified first)."""
    record, meta = checkpoint.read_meta(path)
    _check(cfg, meta, comm.size, path)
    name = checkpoint.rank_file(comm.rank)
    index = checkpoint.read_index(path, record)
    if name not in index["files"]:
        raise CheckpointDamaged(f"checkpoint {path} is damaged", f"file {name}",
                                "the index does not list this rank's file", FALLBACK_HINT)
    saved = checkpoint.TensorFile(path, name, record)
    state: dict[str, Any] = tree.unflatten(index["files"][name],
                                           {k: saved.read(k) for k in saved.keys()})
    return state


def _flat(model: DLRM) -> dict[str, torch.Tensor]:
    """One flat tensor dict (the checkpoint's model file): dense.*, table.weight, table.index.*"""
    flat = {f"dense.{k}": v for k, v in model.dense.state_dict().items()}
    flat["table.weight"] = model.table.weight
    if model.table.index is not None:
        flat |= {f"table.index.{k}": v for k, v in model.table.index.state_dict().items()}
    return flat


def _part(flat: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}


def _model_meta(cfg: RecsysConfig) -> dict[str, Any]:
    return {**asdict(cfg.dlrm()), "optimizer": cfg.optimizer.kind, "seed": cfg.seed}


def _check(cfg: RecsysConfig, meta: dict[str, Any], size: int, path: Path) -> None:
    saved = meta["model"]
    now = _model_meta(cfg)
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {v!r}" for k, v in
             ((k, list(v) if isinstance(v, tuple) else v) for k, v in now.items())
             if saved.get(k) != v]
    if meta["layout"]["shards"] != size:
        diffs.append(f"ranks: checkpoint {meta['layout']['shards']}, now {size} (the table is "
                     "sharded over them)")
    if diffs:
        raise CheckpointError("checkpoint does not match this run", str(path),
                              "differing fields: " + "; ".join(diffs),
                              "Resume with the checkpoint's settings and rank count, or use a "
                              "new --run-dir")


def _broadcast(comm: Communicator, value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=comm_device(comm))
    comm.broadcast(t, 0)
    return int(t)


def _any_failed(comm: Communicator, failed: bool) -> bool:
    t = torch.tensor([int(failed)], dtype=torch.int64, device=comm_device(comm))
    comm.all_reduce(t, ReduceOp.MAX)
    return bool(int(t))


def comm_device(comm: Communicator) -> torch.device:
    """Where a communicator's tensors live: the current CUDA device for NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if comm.backend == "nccl" else \
        torch.device("cpu")
