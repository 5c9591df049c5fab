"""Checkpoints of the recommender, through `trainer.checkpoint` (atomic, checksummed, pruned).

Every rank writes one shard, ``model-tpRR-pp00.pt`` / ``optim-tpRR-pp00.pt`` with RR its rank
(the table shard it holds; the ``tp`` slot of the shard name is the embedding-shard rank here):
the rows (and the hash index) of its table, plus the replicated MLPs and their optimizer, so a
rank reads its own files only. The ranks write together (`trainer.checkpoint.save` with the
world as ``writers``) and rank 0 commits. A resume loads the newest committed checkpoint (rank
0 picks it; every rank verifies its files against the commit record) and must run on the same
number of ranks and the same model; the batch of a step depends on (seed, step) only, so the
continued run is bit-exact.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from trainer import checkpoint
from trainer.checkpoint import CheckpointError
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
    return checkpoint.save(Path(cfg.run_dir) / "checkpoints", step,
                           model=_flat(model),
                           optim={"dense": dense_opt.state_dict(),
                                  "sparse": sparse_opt.state_dict()},
                           meta=meta, keep=cfg.checkpoint.keep, shard=(comm.rank, 0),
                           writers=comm)


def resume(cfg: RecsysConfig, model: DLRM, dense_opt: torch.optim.Optimizer,
           sparse_opt: SparseOptimizer) -> int:
    """Load the newest checkpoint of ``--run-dir`` (collective); its step, 0 when none."""
    comm = model.table.comm
    root = Path(cfg.run_dir) / "checkpoints"
    found = checkpoint.latest(root) if comm.rank == 0 else None
    step = _broadcast(comm, int(found.name.split("-")[1]) if found else 0)
    if step == 0:
        return 0
    error, ckpt = None, None
    try:
        ckpt = checkpoint.load(root / f"step-{step}", shard=(comm.rank, 0))
        _check(cfg, ckpt.meta, comm.size, ckpt.path)
    except CheckpointError as exc:
        error = exc
    if _any_failed(comm, error is not None):
        if error is not None:
            raise error
        raise CheckpointError("checkpoint refused", str(root / f"step-{step}"),
                              "reported by another rank").everywhere(report=False)
    model.dense.load_state_dict(_part(ckpt.model, "dense."))
    table = _part(ckpt.model, "table.")
    if model.table.hashed:
        table["index"] = _part(table, "index.")
    model.table.load_state_dict(table)
    dense_opt.load_state_dict(ckpt.optim["dense"])
    sparse_opt.load_state_dict(ckpt.optim["sparse"])
    return step


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
