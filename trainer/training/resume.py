"""Checkpoints of a training run: what a save records, and how a resume finds and loads it.

The rule of ``--resume``:

* It loads the newest committed checkpoint in ``<run_dir>/checkpoints``. Every rank verifies
  the files it reads (size and sha256 from the commit record), the ZeRO-1 index and optimizer
  shards included, before the checkpoint is chosen. If any rank finds one damaged,
  the run stops with one error naming the checkpoint and the file; nothing is skipped silently.
* ``--resume --resume-fallback`` instead skips a damaged checkpoint and tries the next older
  one, until one verifies. Each skipped folder is reported (which file, why) and renamed to
  ``step-<N>.damaged-<hex>``: kept for inspection, never loaded or pruned again, and out of the
  way of the run's next save of that step. If none verifies the run stops with an error.
* With no checkpoint at all it starts at step 0 and says so (as Megatron's ``--load`` and
  torchtitan's checkpointer do), so one command serves a job's first start and its restarts.

Which checkpoint: global rank 0 picks it and the choice travels to every rank by broadcasts
along DP, then TP, then PP (after the DP broadcast every rank of rank 0's DP group has it,
after TP every rank of the first pipeline stage, after PP everyone), so no rank can load a
different step than the others. The verdicts of the ranks are reduced along the same groups,
so every rank takes the same branch (load, skip, stop) and the lowest failing rank reports.

Without ``--resume`` a run dir holding committed checkpoints is refused at start-up
(`trainer.checkpoint.run_dir`, via `check_run_dir`), unless ``--overwrite`` is given: then
`start_anew` moves the previous run's checkpoints and metrics aside before anything is saved.

What must match: the model config and the layout along the sharded axes (tp, pp, and with a
pipeline the virtual stages and the layers of every stage, since a ``ppNN`` shard holds those
layers); `trainer.checkpoint.check_compatible` lists every difference. dp may change. It is
compared first, from the verified ``meta.json``, before any shard is looked for: a checkpoint
that does not fit is refused once (even with ``--resume-fallback``) and nothing is renamed.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trainer import checkpoint
from trainer.checkpoint import Checkpoint, CheckpointError, run_dir
from trainer.checkpoint.files import FileRecord, verify_file
from trainer.checkpoint.load import load_file, optim_sharded
from trainer.checkpoint.verdict import DAMAGED, OK, agree, quiet
from trainer.comm.protocol import Communicator
from trainer.config.options import TrainConfig
from trainer.training.metrics import METRICS_FILE
from trainer.zero.state import index_name as zero_index_name
from trainer.zero.state import shard_name as zero_shard_name

#: Options that steer one invocation rather than the training math (not reported on resume).
RUN_CONTROL = {"steps", "stop_at", "resume", "resume_fallback", "overwrite", "save_every", "keep",
               "log_every", "run_dir", "dp", "backend", "gpt", "peak_tflops"}


def check_run_dir(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` if its run dir can take this run (`trainer.checkpoint.run_dir.check`)."""
    run_dir.check(Path(cfg.run_dir), resume=cfg.checkpoint.resume,
                  overwrite=cfg.checkpoint.overwrite)
    return cfg


def start_anew(cfg: TrainConfig, *, leader: bool) -> tuple[int, str, None]:
    """What `restore` returns for a run without ``--resume``: step 0, and under ``--overwrite``
    what the ``leader`` (global rank 0, before any save) set aside."""
    said = run_dir.set_aside(Path(cfg.run_dir), [METRICS_FILE]) \
        if cfg.checkpoint.overwrite and leader else ""
    return 0, said, None


def layout_of(cfg: TrainConfig) -> dict[str, Any]:
    """The parallel layout a checkpoint records (and a resume must match along tp and pp)."""
    par = cfg.parallel
    return {"dp": par.dp, "tp": par.tp, "pp": par.pp, "ep": par.ep, "virtual_stages": par.chunks,
            "stage_layers": list(cfg.stage_layers)}


def restore(cfg: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
            deciders: Sequence[Communicator], shard: tuple[int, ...], device: torch.device
            ) -> tuple[int, str, Checkpoint | None]:
    """Load the checkpoint ``--resume`` picks (see the docstring) into ``model``/``optimizer``
    (this rank's (tp, pp) ``shard``); returns its step (0: none), what the banner says about
    it, and the checkpoint (None: none), whose ZeRO-1 optimizer shards, if it has them instead
    of an optimizer file, `trainer.zero.state.load_shards` reads once the shards exist.
    ``deciders``: the DP, TP and PP groups, in that order."""
    root = Path(cfg.run_dir) / "checkpoints"
    leader = all(c.rank == 0 for c in deciders)
    newest_first = sorted(checkpoint.step_dirs(root), reverse=True) if leader else []
    skipped: list[str] = []
    while True:
        step = _broadcast(newest_first[len(skipped)] if len(skipped) < len(newest_first)
                          else -1, deciders, device)
        if step < 0:
            break
        path = root / f"step-{step}"
        ckpt, error = _try_load(cfg, path, shard, (deciders[0].rank, deciders[0].size), device)
        worst, reporter = agree(error, deciders, device)
        if worst == OK:
            assert ckpt is not None  # every rank loaded it
            return step, _apply(cfg, ckpt, model, optimizer, skipped), ckpt
        if worst != DAMAGED or not cfg.checkpoint.resume_fallback:
            raise (error if error is not None else quiet(path)).everywhere(report=reporter)
        if reporter:
            print(f"dtrain: --resume-fallback skips {path.name}: {error.what} [{error.where}]: "
                  f"{error.why}", file=sys.stderr, flush=True)
        skipped.append(_set_aside(path) if leader else path.name)
    if skipped:
        raise CheckpointError(
            "no checkpoint verifies", str(root),
            f"--resume-fallback set aside {', '.join(skipped)}: each is damaged (see above)",
            "Restore the files from a copy, or start the run again without --resume"
        ).everywhere(report=leader)
    return 0, f"--resume found no checkpoint in {root}: starting at step 0", None


def _try_load(cfg: TrainConfig, path: Path, shard: tuple[int, ...], dp_member: tuple[int, int],
              device: torch.device) -> tuple[Checkpoint | None, CheckpointError | None]:
    """This rank's part of ``path``, or why not: a checkpoint of another model or layout is
    refused (never "damaged") from its verified meta.json before any shard is looked for, so
    --resume-fallback never sets aside a good checkpoint that merely does not fit.
    ``dp_member``: this rank's (rank, size) in its DP group."""
    if not path.is_dir():
        return None, CheckpointError(
            "checkpoint not visible on this rank", str(path),
            f"rank 0 resumes from {path.name} but this rank (tp, pp shard {shard}) cannot see "
            "the folder", "Put --run-dir on a filesystem that every host shares")
    try:
        read = checkpoint.read_meta(path)
        _check_fits(cfg, path, shard, *read)
        ckpt = checkpoint.load(path, map_location=device, shard=shard, read=read)
        if ckpt.optim is None:
            _verify_zero_files(ckpt, shard, dp_member, device)
        return ckpt, None
    except CheckpointError as exc:
        return None, exc


def _verify_zero_files(ckpt: Checkpoint, shard: tuple[int, ...], dp_member: tuple[int, int],
                       device: torch.device) -> None:
    """Verify the ZeRO-1 files of this rank's stage before the checkpoint is chosen, so that
    --resume-fallback covers them: the index, then the saved DP shards, shared out over this
    run's DP ranks (each file hashed once per stage; at the same dp every rank takes its own,
    the one `trainer.zero.state.load_shards` will read)."""
    index = load_file(ckpt.path, zero_index_name(*shard[:2]), ckpt.record, device)
    saved_dp = int(index["dp"]) if isinstance(index, dict) and "dp" in index else 0
    rank, size = dp_member
    for saved_rank in range(rank, saved_dp, size):
        verify_file(ckpt.path, zero_shard_name(*shard[:2], saved_rank), ckpt.record)


def _check_fits(cfg: TrainConfig, path: Path, shard: tuple[int, ...],
                record: dict[str, FileRecord], meta: dict[str, Any]) -> None:
    """Refuse a checkpoint of another model, sharded layout or optimizer sharding."""
    checkpoint.check_compatible(meta, model=cfg.gpt.to_dict(), layout=layout_of(cfg), path=path)
    if optim_sharded(record, shard) and not cfg.optimizer.zero:
        raise CheckpointError(
            "checkpoint does not match this run", str(path),
            "its optimizer state is sharded over data parallelism (ZeRO-1); this run has "
            "--zero 0", "Resume with --zero 1 (at any --dp), or use a new --run-dir")


def _broadcast(step: int, deciders: Sequence[Communicator], device: torch.device) -> int:
    choice = torch.tensor([step], dtype=torch.int64, device=device)
    for comm in deciders:
        comm.broadcast(choice, 0)
    return int(choice)


def _set_aside(path: Path) -> str:
    """Rename a skipped damaged checkpoint out of the committed set; returns what it became."""
    aside = path.with_name(f"{path.name}{checkpoint.DAMAGED_SUFFIX}{secrets.token_hex(4)}")
    path.rename(aside)
    return f"{path.name} (now {aside.name})"


def _apply(cfg: TrainConfig, ckpt: Checkpoint, model: torch.nn.Module,
           optimizer: torch.optim.Optimizer, skipped: list[str]) -> str:
    """Put the state of ``ckpt`` (it fits this run: `_check_fits`) back; the banner's words."""
    model.load_state_dict(ckpt.model)
    if ckpt.optim is not None:  # else the ZeRO-1 shards, read once the optimizer is built
        optimizer.load_state_dict(ckpt.optim)
    checkpoint.restore_rng(ckpt.rng)
    before, now = ckpt.meta.get("config", {}), cfg.to_dict()
    changed = [f"{k} {before[k]!r} -> {v!r}" for k, v in now.items()
               if k not in RUN_CONTROL and k in before and before[k] != v]
    said = f"resumed at step {ckpt.step}"
    if skipped:
        said += f" (--resume-fallback set aside damaged {', '.join(skipped)})"
    if changed:
        said += " with changed options: " + ", ".join(changed)
    return said


def meta_of(cfg: TrainConfig, step: int, *, source: str, fingerprint: str,
            samples: dict[str, Any] | None = None) -> dict[str, Any]:
    """The meta.json body of a save at ``step``; ``samples``: the tokenized data's position
    (`trainer.data.token_batches.Position`; byte-level data's is the step itself)."""
    data = {"position": step, "source": source, "fingerprint": fingerprint}
    return {"config": cfg.to_dict(), "model": cfg.gpt.to_dict(), "layout": layout_of(cfg),
            "data": data if samples is None else {**data, "samples": samples}}
