"""Checkpoints of a training run: what a save records, and how a resume finds and loads it, at
any layout.

The rule of ``--resume``:

* It loads the newest committed checkpoint in ``<run_dir>/checkpoints``. Every rank verifies
  every file it will read (size and sha256 from the commit record: ``meta.json``,
  ``index.json``, the RNG file and the tensor files that hold its slices) before the
  checkpoint is chosen. If any rank finds one damaged, the run stops with one error naming the
  checkpoint and the file; nothing is skipped silently.
* ``--resume --resume-fallback`` instead skips a damaged checkpoint and tries the next older
  one, until one verifies. Each skipped folder is reported (which file, why) and renamed to
  ``step-<N>.damaged-<hex>``: kept for inspection, never loaded or pruned again, and out of the
  way of the run's next save of that step. If none verifies the run stops with an error.
* With no checkpoint at all it starts at step 0 and says so (as Megatron's ``--load`` and
  torchtitan's checkpointer do), so one command serves a job's first start and its restarts.
  With no committed checkpoint but checkpoint-like content it cannot use (a ``step-<N>`` that
  is a link, a file or a folder of other files, or only checkpoints set aside as damaged) it
  stops with an error naming them (`trainer.checkpoint.run_dir.unusable`): starting over at
  step 0 would quietly throw away the run those stand for, on every automatic restart too.
  The leftover of a save that died before its commit (the first one) is no such content: the
  banner names it and the run starts at step 0.
* ``<run_dir>/checkpoints`` may be a symbolic link to another disk: it is resolved once
  (`trainer.checkpoint.run_dir.folder`), and links among the steps are never followed.

Which checkpoint: global rank 0 picks it and broadcasts the choice over the world, so no rank
can load a different step than the others; the ranks' verdicts are reduced over the world, so
every rank takes the same branch (load, skip, stop) and the lowest failing rank reports.

Without ``--resume`` a run dir holding committed checkpoints is refused at start-up
(`trainer.checkpoint.run_dir`, via `check_run_dir`), unless ``--overwrite`` is given: then
`start_anew` moves the previous run's checkpoints and metrics aside before anything is saved.

What must match: the model, and nothing else. Every axis of the mesh, the virtual stages,
``--pp-layers``, ``--zero`` and the precision of the main weights may all differ: every rank
reads the slices of the saved tensors that its own placement needs
(`trainer.checkpoint.pieces`). A checkpoint of another model is refused from its verified
``meta.json`` before any tensor file is looked at, listing every differing field, once (even
with ``--resume-fallback``), and nothing is renamed.
"""

from __future__ import annotations

import secrets
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from trainer import checkpoint
from trainer.checkpoint import CheckpointError, run_dir
from trainer.checkpoint.files import FileRecord, TensorFile
from trainer.checkpoint.pieces import (
    MOMENTS,
    PARAM,
    Held,
    ReadPlan,
    held,
    install,
    plan,
    read,
    slices_index,
)
from trainer.checkpoint.verdict import DAMAGED, OK, agree, quiet
from trainer.comm.mesh import Mesh
from trainer.config.options import TrainConfig
from trainer.optim.main_weights import MainWeights
from trainer.training.metrics import METRICS_FILE

#: Options that steer one invocation rather than the training math (not reported on resume).
RUN_CONTROL = {"steps", "stop_at", "resume", "resume_fallback", "overwrite", "save_every", "keep",
               "log_every", "run_dir", "dp", "backend", "peak_tflops"}


@dataclass(frozen=True)
class Restored:
    """Where a run starts: the checkpoint's step (0: none), what the banner says, and which
    tensor files this rank read and their bytes."""

    step: int = 0
    said: str = ""
    files: tuple[str, ...] = ()
    bytes: int = 0
    samples: dict[str, Any] | None = None
    """The tokenized data's position at the checkpoint (`trainer.data.token_batches`)."""
    warning: str = ""
    """What the resumed run trains differently from the saved one (`moe_objective`)."""


def check_run_dir(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` if its run dir can take this run (`trainer.checkpoint.run_dir.check`)."""
    run_dir.check(Path(cfg.run_dir), resume=cfg.checkpoint.resume,
                  overwrite=cfg.checkpoint.overwrite)
    return cfg


def start_anew(cfg: TrainConfig, *, leader: bool) -> Restored:
    """What `restore` returns for a run without ``--resume``: step 0, and under ``--overwrite``
    what the ``leader`` (global rank 0, before any save) set aside."""
    said = run_dir.set_aside(Path(cfg.run_dir), [METRICS_FILE]) \
        if cfg.checkpoint.overwrite and leader else ""
    return Restored(0, said)


def layout_of(cfg: TrainConfig) -> dict[str, Any]:
    """The parallel layout a checkpoint records (a resume may use another)."""
    par = cfg.parallel
    return {**asdict(par.mesh()), "virtual_stages": par.chunks,
            "stage_layers": list(cfg.stage_layers), "zero": cfg.optimizer.zero}


@dataclass
class _Chosen:
    """A checkpoint this rank can load: what it read and verified, and where each of its
    tensors comes from."""

    record: dict[str, FileRecord]
    meta: dict[str, Any]
    held: list[Held]
    moments: list[dict[str, torch.Tensor]]
    plan: ReadPlan
    targets: list[torch.Tensor]
    rng: TensorFile


def restore(cfg: TrainConfig, mesh: Mesh, weights: MainWeights) -> Restored:
    """Load the checkpoint ``--resume`` picks (see the docstring) into ``weights`` (this rank's
    slices, AdamW's moments and step count), then the model follows them; collective over the
    mesh's world."""
    root = run_dir.folder(Path(cfg.run_dir))
    world, device = mesh.group(), mesh.device
    leader = world.rank == 0
    newest_first = sorted(checkpoint.step_dirs(root), reverse=True) if leader else []
    skipped: list[str] = []
    mine = held(weights.values(), weights.optimizer)
    while True:
        step = _broadcast(newest_first[len(skipped)] if len(skipped) < len(newest_first)
                          else -1, mesh)
        if step < 0:
            break
        path = root / f"step-{step}"
        chosen, error = _try(cfg, path, mine, mesh)
        worst, reporter = agree(error, world, device)
        if worst == OK:
            assert chosen is not None  # every rank planned its reads
            return _apply(cfg, path, chosen, weights, skipped, mesh)
        if worst != DAMAGED or not cfg.checkpoint.resume_fallback:
            raise (error if error is not None else quiet(path)).everywhere(report=reporter)
        if reporter and error is not None:  # the reporter is a rank that failed
            print(f"dtrain: --resume-fallback skips {path.name}: {error.what} [{error.where}]: "
                  f"{error.why}", file=sys.stderr, flush=True)
        skipped.append(_set_aside(path) if leader else path.name)
    if skipped:
        raise CheckpointError(
            "no checkpoint verifies", str(root),
            f"--resume-fallback set aside {', '.join(skipped)}: each is damaged (see above)",
            "Restore the files from a copy, or start the run again without --resume"
        ).everywhere(report=leader)
    unusable = run_dir.unusable(root) if leader else None
    if _broadcast(int(unusable is not None), mesh):
        raise (unusable or quiet(root)).everywhere(report=leader)
    return Restored(0, f"--resume found no checkpoint in {root}{run_dir.unfinished(root)}: "
                    "starting at step 0")


def _try(cfg: TrainConfig, path: Path, mine: list[Held], mesh: Mesh
         ) -> tuple[_Chosen | None, CheckpointError | None]:
    """What this rank would read of ``path``, every file of it verified, or why not. A
    checkpoint of another model is refused (never "damaged") from its verified meta.json
    before any tensor file is looked at, so --resume-fallback never sets aside a good
    checkpoint that merely does not fit."""
    if not path.is_dir():
        return None, CheckpointError(
            "checkpoint not visible on this rank", str(path),
            f"rank 0 resumes from {path.name} but rank {mesh.rank()} cannot see the folder",
            "Put --run-dir on a filesystem that every host shares")
    try:
        record, meta = checkpoint.read_meta(path)
        checkpoint.check_compatible(meta, model=cfg.gpt.to_dict(), path=path)
        index = slices_index(path, record)
        saved_kinds = {e["kind"] for entries in index["files"].values() for e in entries or ()}
        moments = [{k: torch.zeros_like(h.tensor) for k in MOMENTS if k in saved_kinds}
                   for h in mine]
        targets = [(PARAM, h.placement, h.tensor.view(-1)) for h in mine] + [
            (kind, h.placement, t.view(-1)) for h, m in zip(mine, moments, strict=True)
            for kind, t in m.items()]
        reads = plan(path, index, record, [(kind, p) for kind, p, _ in targets])
        rng = TensorFile(path, checkpoint.RNG, record)
        return _Chosen(record, meta, mine, moments, reads, [t for _, _, t in targets], rng), \
            None
    except CheckpointError as exc:
        return None, exc


def _apply(cfg: TrainConfig, path: Path, chosen: _Chosen, weights: MainWeights,
           skipped: list[str], mesh: Mesh) -> Restored:
    """Read this rank's slices into the weights and the moments, bring the model to them, put
    back AdamW's state and the random streams; the banner's words about it. An error reading
    on any rank stops every rank (no rank is left waiting in the model's all-gather)."""
    error = None
    try:
        read(chosen.plan, chosen.targets)
    except CheckpointError as exc:
        error = exc
    except (OSError, RuntimeError, ValueError) as exc:
        error = CheckpointError("checkpoint unreadable", str(path), f"{type(exc).__name__}: "
                                f"{exc}", "Restore the checkpoint from a copy, or start a new "
                                "--run-dir")
    worst, reporter = agree(error, mesh.group(), mesh.device)
    if worst != OK:
        raise (error if error is not None else quiet(path)).everywhere(report=reporter)
    opt = chosen.meta["optimizer"]
    install(weights.optimizer, chosen.held, chosen.moments, int(opt["step"]), opt["groups"])
    weights.publish()
    checkpoint.restore_rng(path, chosen.record, chosen.meta)
    step = int(chosen.meta["step"])
    before, now = chosen.meta.get("config", {}), cfg.to_dict()
    changed = [f"{k} {before[k]!r} -> {v!r}" for k, v in now.items()
               if k not in RUN_CONTROL and k in before and before[k] != v]
    said = f"resumed at step {step}"
    if skipped:
        said += f" (--resume-fallback set aside damaged {', '.join(skipped)})"
    if changed:
        said += " with changed options: " + ", ".join(changed)
    files = tuple(sorted(chosen.plan.opened))
    return Restored(step, said, files, chosen.plan.bytes(chosen.record),
                    chosen.meta["data"].get("samples"), moe_objective(cfg, chosen.meta, path))


def moe_objective(cfg: TrainConfig, meta: dict[str, Any], path: Path) -> str:
    """The warning for a MoE run resumed with another number of sequences per microbatch ("":
    none). The load-balancing (and z-) loss is computed per microbatch over its own tokens
    (`trainer.parallel.expert.router`), so its value and gradient depend on how many sequences one
    microbatch holds: global batch / (dp x microbatches). The language-model loss does not."""
    saved, layout = meta.get("config", {}), meta.get("layout", {})
    try:
        before = int(saved["global_batch"]) // (int(layout["dp"]) * int(saved["microbatches"]))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return ""
    if not cfg.gpt.moe.experts or before == cfg.micro_batch:
        return ""
    return (f"warning: MoE load balancing changes on resume [{path.name}]: the checkpoint "
            f"trained with {before} sequence(s) per microbatch (global batch "
            f"{saved['global_batch']} over dp {layout['dp']} x {saved['microbatches']} "
            f"microbatches), this run with {cfg.micro_batch}; the load-balancing loss is "
            "computed per microbatch, over its tokens, so from here on the auxiliary objective "
            "is another one (the language-model loss is the same). Resume with dp x "
            "--microbatches = "
            f"{int(layout['dp']) * int(saved['microbatches'])} to keep it")


def _broadcast(step: int, mesh: Mesh) -> int:
    choice = torch.tensor([step], dtype=torch.int64, device=mesh.device)
    mesh.group().broadcast(choice, 0)
    return int(choice)


def _set_aside(path: Path) -> str:
    """Rename a skipped damaged checkpoint out of the committed set; returns what it became."""
    aside = path.with_name(f"{path.name}{checkpoint.DAMAGED_SUFFIX}{secrets.token_hex(4)}")
    path.rename(aside)
    return f"{path.name} (now {aside.name})"


def meta_of(cfg: TrainConfig, step: int, *, source: str, fingerprint: str,
            optimizer: dict[str, Any], samples: dict[str, Any] | None = None,
            run_part: dict[str, Any] | None = None) -> dict[str, Any]:
    """The meta.json body of a save at ``step`` (``optimizer``: AdamW's step count and the
    hyperparameters of its groups; ``samples``: the tokenized data's position,
    `trainer.data.token_batches.Position`, where byte-level data's is the step itself;
    ``run_part``: `run_meta`'s, when the caller kept it)."""
    data = {"position": step, "source": source, "fingerprint": fingerprint}
    return {**(run_part or run_meta(cfg)),
            "data": data if samples is None else {**data, "samples": samples},
            "optimizer": optimizer}


def run_meta(cfg: TrainConfig) -> dict[str, Any]:
    """The part of meta.json that is the same at every save of a run (its configuration):
    a caller may keep it and pass it to `meta_of` (it is nearly all of `meta_of`'s time: 0.04
    ms alone, 0.2 ms on the leader at a save of 8 ranks on 2 cores, while the training loop
    waits; the kept dict is only read after)."""
    return {"config": cfg.to_dict(), "model": cfg.gpt.to_dict(), "layout": layout_of(cfg)}
