"""Train a DLRM click model on sharded embeddings, data parallel over the ranks of the job.

    python -m trainer.recsys --steps 300 --run-dir runs/rec                  # one process
    mpiexec -n 4 python -m trainer.recsys --steps 300 --run-dir runs/rec4    # table over 4
    dtrain launch --nproc-per-node 2 -- python -m trainer.recsys --run-dir runs/rec
    python -m trainer.recsys --data day_0.tsv --vocab 100000 --rows 1000000  # Criteo TSV
    python -m trainer.recsys --run-dir runs/rec --resume     # continue the newest checkpoint

Every rank holds the MLPs (data parallel, `trainer.parallel.data.grad_sync`: gradients averaged in
buckets) and 1/G of the embedding table (`trainer.sparse`). A step: each rank takes its 1/G of
the step's global batch (a pure function of seed and step, `trainer.recsys.data.Batches`),
looks its keys up through the all-to-all, runs the MLPs and the interaction, and backward sends
the embedding gradients to their owners; then the dense optimizer (SGD, Adagrad or Adam) and
the row-wise sparse one (`trainer.sparse.optim`) step. Rank 0 logs and writes ``metrics.jsonl``
and ``loss.png`` (`trainer.training.metrics`; "tokens" are rows) and, every ``--eval-every`` steps,
validation log-loss and AUC (`trainer.recsys.evaluate`: ``evals.jsonl``, ``auc.png`` with the
planted model's AUC as the ceiling). Checkpoints (`trainer.recsys.state`) hold one shard per
rank; ``--resume`` continues bit-exactly. Bad options are reported once, by rank 0
(`trainer.training.startup`'s agreement), with exit code 2.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from torch.nn import functional

from trainer.checkpoint.run_dir import set_aside
from trainer.comm.bootstrap import World, init
from trainer.comm.protocol import ReduceOp
from trainer.errors import ConfigError, TrainerError
from trainer.parallel.data.grad_sync import DataParallel
from trainer.recsys import evaluate, state
from trainer.recsys.config import RecsysConfig, check_rows, check_world, parse_args
from trainer.recsys.data import Batches, ClickLog, read_criteo, synthetic
from trainer.recsys.model import DLRM
from trainer.sparse import SparseOptimizer
from trainer.training import startup
from trainer.training.metrics import METRICS_FILE, MetricsLog, StepRecord

_DENSE_OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad,
                     "adam": torch.optim.Adam}


@dataclass
class RecsysResult:
    """What a run did on this rank: losses of its steps, evaluations, the last checkpoint."""

    start_step: int
    losses: list[float] = field(default_factory=list)
    evals: dict[int, dict[str, float]] = field(default_factory=dict)
    ceiling: float | None = None
    checkpoint: Path | None = None


@dataclass
class Trainer:
    cfg: RecsysConfig
    model: DLRM
    dp: DataParallel
    dense_opt: torch.optim.Optimizer
    sparse_opt: SparseOptimizer
    batches: Batches
    device: torch.device

    def step(self, step: int) -> tuple[float, dict[str, float]]:
        """One optimizer step; returns the global batch's mean loss and the phase times (plus
        ``grad_norm``, the MLPs' gradient norm)."""
        self.dp.zero_grad()
        self.sparse_opt.zero_grad()
        batch = self.batches.at(step)
        start = time.perf_counter()
        dtype = self.model.table.weight.dtype
        logits = self.model.logits(batch.dense.to(self.device, dtype),
                                   batch.sparse.to(self.device))
        loss = functional.binary_cross_entropy_with_logits(logits,
                                                           batch.labels.to(self.device, dtype))
        loss.backward()
        self.dp.finish_grad_sync()
        norm = float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(p.grad) for p in self.model.dense.parameters()])))
        self.dense_opt.step()
        self.sparse_opt.step()
        total = time.perf_counter() - start
        phases = self.model.table.take_timings()
        phases["dense"] = total - sum(phases.values())  # interaction, MLPs, optimizers, DP
        phases["grad_norm"] = norm  # of the MLPs' averaged gradient (same on every rank)
        mean = loss.detach().clone()
        self.dp.comm.all_reduce(mean, ReduceOp.AVG)
        return float(mean), phases


def load_log(cfg: RecsysConfig) -> ClickLog:
    if cfg.data.path:
        return read_criteo(Path(cfg.data.path), cfg.data.vocab_sizes, limit=cfg.data.rows)
    return synthetic(cfg.data.rows, cfg.data.vocab_sizes, seed=cfg.seed, zipf=cfg.data.zipf)


def build(cfg: RecsysConfig, world: World, train_rows: ClickLog,
          dtype: torch.dtype = torch.float32) -> Trainer:
    """The model, optimizers and batches of this rank (``dtype``: of rows and MLPs)."""
    model = DLRM(cfg.dlrm(), world.comm, seed=cfg.seed, device=world.device, dtype=dtype)
    opt = cfg.optimizer
    dense_opt = _DENSE_OPTIMIZERS[opt.kind](model.dense.parameters(), lr=opt.lr)
    sparse_opt = SparseOptimizer([model.table], kind=opt.kind, lr=opt.embedding_lr)
    dp = DataParallel(model.dense, world.comm)
    batches = Batches(train_rows, cfg.data.global_batch, cfg.seed, world.rank, world.size)
    return Trainer(cfg, model, dp, dense_opt, sparse_opt, batches, world.device)


def train(cfg: RecsysConfig, world: World) -> RecsysResult:
    """Train on this rank of ``world``; every rank returns the same losses and evaluations."""
    check_world(cfg, world.size)
    train_rows, val = load_log(cfg).split(cfg.data.val_fraction)
    try:  # every rank read the same log: all refuse it together, rank 0 says why
        check_rows(cfg.data, len(train_rows))
    except ConfigError as exc:
        raise exc.everywhere(report=world.rank == 0) from None
    run = build(cfg, world, train_rows)
    start = state.resume(cfg, run.model, run.dense_opt, run.sparse_opt) \
        if cfg.checkpoint.resume else 0
    result = RecsysResult(start, ceiling=evaluate.ceiling(val))
    writer, run_dir = world.rank == 0, Path(cfg.run_dir)
    replaced = set_aside(run_dir, [METRICS_FILE, evaluate.EVALS_FILE]) \
        if cfg.checkpoint.overwrite and writer else ""
    log = MetricsLog(run_dir, enabled=writer, total_steps=cfg.steps, start_step=start,
                     log_every=cfg.logging.log_every)
    log.info(_banner(cfg, run, world.size, len(train_rows), len(val), result.ceiling, start))
    log.info(replaced)
    if writer:
        log.info(evaluate.truncate(run_dir, start))
    try:
        for step in range(start + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            loss, phases = run.step(step)
            rec = StepRecord(step=step, loss=loss, lr=cfg.optimizer.lr,
                             grad_norm=phases["grad_norm"],
                             tokens=cfg.data.global_batch, step_s=time.perf_counter() - t0,
                             compute_s=phases["lookup"] + phases["dense"],
                             comm_exposed_s=phases["dispatch"] + phases["return"] +
                             phases["backward"])
            if cfg.logging.eval_every and (step % cfg.logging.eval_every == 0 or step == cfg.steps):
                result.evals[step] = evaluate.evaluate(run.model, val)
                rec = StepRecord(**{**rec.__dict__, "val_loss": result.evals[step]["val_loss"]})
                if writer:
                    evaluate.record(run_dir, step, result.evals[step])
                log.info(f"step {step:>6} | validation log-loss "
                         f"{result.evals[step]['val_loss']:.4f} | AUC "
                         f"{result.evals[step]['val_auc']:.4f}")
            log.record(rec)
            result.losses.append(loss)
            every = cfg.checkpoint.save_every
            if every and step % every == 0 and step != cfg.steps:
                state.save(cfg, step, run.model, run.dense_opt, run.sparse_opt)
        result.checkpoint = state.save(cfg, max(cfg.steps, start), run.model, run.dense_opt,
                                       run.sparse_opt)
    finally:
        log.close(plot_title=f"DLRM on {world.size} rank(s), global batch {cfg.data.global_batch}")
        if writer:
            log.info(evaluate.plot(run_dir, result.ceiling,
                                   f"DLRM validation AUC, {world.size} rank(s)"))
    return result


def _banner(cfg: RecsysConfig, run: Trainer, ranks: int, n_train: int, n_val: int,
            ceiling: float | None, start: int) -> str:
    table = run.model.table
    mode = (f"hash mode, {cfg.model.hash_capacity:,} rows per rank" if table.hashed else
            f"{table.num_rows:,} rows, {len(table.weight):,} on rank 0")
    planted = f" | planted-model AUC {ceiling:.4f}" if ceiling is not None else ""
    resumed = f" | resumed at step {start}" if start else ""
    return (f"dtrain recsys: DLRM, {run.model.cfg.features} sparse features x {cfg.model.dim} dims "
            f"({mode}) over {ranks} rank(s) | {cfg.optimizer.kind} | {n_train:,} training / "
            f"{n_val:,} validation rows of {run.batches.log.source}{planted}{resumed}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 0 on success, 2 on bad input (printed once) or an error in training."""
    world = None
    try:
        quiet = startup.env_rank() != 0
        cfg, failed = startup.attempt(lambda: parse_args(argv, quiet=quiet))
        failed = startup.agree(startup.world_comm(), failed)
        if failed is None:
            world, failed = startup.attempt(lambda: _join(cast(RecsysConfig, cfg)))
            failed = startup.agree(startup.world_comm(), failed)
        if failed is not None:
            return failed.code
        train(cast(RecsysConfig, cfg), cast(World, world))
        return 0
    except TrainerError as exc:
        return startup.fail_alone(world, f"error: {exc}", 2, exc)
    except KeyboardInterrupt:
        return startup.fail_alone(world, "interrupted", 130)
    except Exception as exc:  # noqa: BLE001 - report, then abort the other ranks
        import traceback

        traceback.print_exc()
        return startup.fail_alone(world, f"error: unexpected {type(exc).__name__}: {exc}", 1)


def _join(cfg: RecsysConfig) -> World:
    world = init(backend=cfg.backend)
    check_world(cfg, world.size)
    return world


if __name__ == "__main__":
    sys.exit(main())
