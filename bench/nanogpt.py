"""One process's training step: dtrain against karpathy/nanoGPT's own ``model.py``, and where
the difference goes.

    python -m bench.nanogpt [--model small] [--batch 8] [--threads 1] [--steps 10]
                            [--nanogpt PATH/model.py] [--json PATH]

nanoGPT's code is not part of this repository (it is MIT-licensed, but we keep none of it):
the bench imports ``model.py`` from ``--nanogpt`` (or ``$NANOGPT_MODEL_PY``), else downloads
it at the pinned commit into a temporary directory. Either way the file's sha256 must be the
pinned one before it is imported, since importing runs it. Without the file and without a
network the bench is skipped with that reason.

Sides, one worker process (``mpiexec -n 1``) with ``--threads`` torch threads, their steps
interleaved with the order rotating every round (drifting load hits all alike); the median and
the fastest of the timed steps, and the median CPU time of the step's thread (``--threads 1``:
on a loaded machine far steadier than wall time, which waits for a core):

* ``nanogpt``: nanoGPT's ``GPT`` at the preset's layers, width, heads and sequence length
  (vocabulary 256, dropout 0, ``bias=False`` as dtrain's linears), its ``configure_optimizers``
  (AdamW, decay on 2-D tensors, torch's per-tensor loop on a CPU) and its ``train.py`` step:
  loss, backward, ``clip_grad_norm_(1.0)``, step, ``zero_grad(set_to_none=True)``; one fixed
  batch in memory.
* ``nanogpt-onednn``: the same nanoGPT model and loop with each of its ``nn.Linear`` layers
  multiplying through dtrain's linear kernel (`trainer.model.linear`: oneDNN for fp32 on a
  CPU, where torch's own ``aten::mm`` runs MKL's sgemm): dtrain's sides against this row are
  the comparison at equal matrix-product kernels, the rest of dtrain's step alone.
* ``dtrain-model``: dtrain's plain `trainer.model.gpt.GPT` (rotary positions, LayerNorm with
  a bias, tied head) in that same loop with dtrain's AdamW: the models' difference alone.
* ``dtrain``: ``build_run`` + ``run_step``, as ``python -m trainer.train`` steps at dp = tp =
  pp = 1 in fp32: the DP gradient buffer, the global norm and clipping, the guard's finite
  check, the batch drawn from the corpus, the step record.

Breakdown rows (ms per step, each part timed alone on the built sides, median of repeats):
``rotary`` (q, k and v out of the qkv projection with q and k rotated, every layer, forward
and backward; nanoGPT's counterpart splits the heads without rotating),
``zero_grad`` (the DP buffer zeroed, against nanoGPT's set_to_none), ``clip`` (dtrain's norm
and clip against torch's ``clip_grad_norm_``), ``guard`` (the finite check), ``batch`` (drawing
the step's batch). Target (issue 40): dtrain <= 0.97x nanoGPT by the median of 30 steps.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from bench import common, rankjobs

NANOGPT_COMMIT = "3adf61e154c3fe3fca428ad6bc3818b27a3b8291"
NANOGPT_URL = f"https://raw.githubusercontent.com/karpathy/nanoGPT/{NANOGPT_COMMIT}/model.py"
NANOGPT_SHA256 = "7c01703240dbec5d554527dc666e35b3df8391d0b117fddc07afcf325a21d11c"
SIDES = ("nanogpt", "nanogpt-onednn", "dtrain-model", "dtrain")
WARMUP = 3
SUMMARY_NOTE = (
    "Ratios are to nanoGPT's step in the same run (median of the timed steps; CPU: median CPU "
    "time of the step's thread, steadier than wall time on a loaded machine). "
    "`nanogpt-onednn` is nanoGPT's model and loop with its linears on dtrain's kernel "
    "(`trainer.model.linear`: oneDNN for fp32 on a CPU, where torch's `aten::mm` runs MKL); "
    "the `vs nanoGPT-oneDNN` columns compare at equal matrix-product kernels. Parts: ms per "
    "step, each timed alone, with nanoGPT's counterpart.")
SUMMARY_COLUMNS = [("side", "side"), ("step ms", "step_ms"), ("vs nanoGPT", "ratio"),
                   ("min ms", "min_ms"), ("min vs nanoGPT", "min_ratio"), ("CPU ms", "cpu_ms"),
                   ("CPU vs nanoGPT", "cpu_ratio"), ("vs nanoGPT-oneDNN", "same_kernel_ratio"),
                   ("CPU vs nanoGPT-oneDNN", "same_kernel_cpu_ratio"),
                   ("nanoGPT part ms", "nanogpt_ms"), ("threads", "threads"), ("batch", "batch"),
                   ("seq", "seq_len")]


def nanogpt_source(given: str | None, tmp: Path) -> Path:
    """The pinned ``model.py``: the given file, or downloaded into ``tmp``; its hash checked."""
    path = Path(given) if given else tmp / "model.py"
    if not given:
        try:
            with urllib.request.urlopen(NANOGPT_URL, timeout=20) as answer:  # noqa: S310
                path.write_bytes(answer.read())
        except OSError as exc:
            raise common.Skip(f"nanoGPT's model.py could not be downloaded ({exc}); pass "
                              "--nanogpt PATH (model.py of karpathy/nanoGPT at "
                              f"{NANOGPT_COMMIT[:12]})") from None
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != NANOGPT_SHA256:
        raise common.Skip(f"{path} is not nanoGPT's model.py at {NANOGPT_COMMIT[:12]} (sha256 "
                          f"{digest[:16]}..., expected {NANOGPT_SHA256[:16]}...)")
    return path


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


class Timed:
    """A side: ``step(i)`` runs one step and keeps its time when timed."""

    def __init__(self, name: str, step: Callable[[int], None]) -> None:
        self.name, self._step = name, step
        self.times, self.cpu_times = list[float](), list[float]()

    def step(self, i: int, timed: bool) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        self._step(i)
        if timed:
            self.times.append(time.perf_counter() - start)
            self.cpu_times.append(time.thread_time() - cpu)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from bench.gpu_sides import mesh_of_one
    from trainer.comm.bootstrap import init
    from trainer.config.options import make_config
    from trainer.model.gpt import GPT
    from trainer.model.layers import RotaryQKV
    from trainer.optim.grad_clip import clip_grad_norm
    from trainer.optim.optimizer import build_optimizer
    from trainer.training.run import build_run
    from trainer.training.step import run_step

    torch.set_num_threads(args.threads)
    world = init(backend="mpi")
    tmp = Path(args.out)
    cfg = make_config({"model": args.model, "steps": 10_000, "global_batch": args.batch,
                       "dp": 1, "eval_every": 0, "warmup_steps": 10, "data_cap_mb": 2.0,
                       "run_dir": str(tmp / "run"), "seed": 0}, {"dropout": 0.0})
    g, opt = cfg.gpt, cfg.optimizer
    ng = _load(Path(args.nanogpt))
    theirs = ng.GPT(ng.GPTConfig(block_size=g.seq_len, vocab_size=g.vocab_size,
                                 n_layer=g.n_layer, n_head=g.n_head, n_embd=g.d_model,
                                 dropout=0.0, bias=False))
    their_opt = theirs.configure_optimizers(opt.weight_decay, opt.lr, (0.9, 0.95), "cpu")
    same = common.with_dtrain_linears(ng.GPT(theirs.config))
    same_opt = same.configure_optimizers(opt.weight_decay, opt.lr, (0.9, 0.95), "cpu")
    ours = GPT(g, seed=0)
    our_opt = build_optimizer(ours, lr=opt.lr, weight_decay=opt.weight_decay)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, g.vocab_size, (args.batch, g.seq_len), generator=gen)
            for _ in range(2))

    def plain(loss_of: Callable[[], torch.Tensor], model: torch.nn.Module,
              optimizer: torch.optim.Optimizer) -> Callable[[int], None]:
        def step(_: int) -> None:
            loss_of().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return step

    run = build_run(cfg, mesh_of_one(world))
    sides = [Timed("nanogpt", plain(lambda: theirs(x, y)[1], theirs, their_opt)),
             Timed("nanogpt-onednn", plain(lambda: same(x, y)[1], same, same_opt)),
             Timed("dtrain-model", plain(lambda: ours.loss(x, y), ours, our_opt)),
             Timed("dtrain", lambda i: run_step(run, i).loss.item())]
    rankjobs.interleave(world, sides, warmup=WARMUP, steps=args.steps)

    repeats = max(5, args.steps)
    qkv = torch.randn((args.batch, g.seq_len, 3 * g.d_model), requires_grad=True)
    grads = [torch.randn(args.batch, g.seq_len, g.n_head, g.head_dim).transpose(1, 2)
             for _ in range(3)]  # laid out as the attention kernel's gradients are
    cos, sin = run.model.rope_cos, run.model.rope_sin

    def rotary() -> None:
        for _ in range(g.n_layer):
            torch.autograd.backward(RotaryQKV.apply(qkv, cos, sin, g.head_dim), grads)

    def split_heads() -> None:  # nanoGPT's counterpart: split, view and transpose, no rotary
        for _ in range(g.n_layer):
            heads = [t.view(args.batch, g.seq_len, g.n_head, g.head_dim).transpose(1, 2)
                     for t in qkv.split(g.d_model, dim=2)]
            torch.autograd.backward(heads, grads)

    loss, norm = torch.tensor(3.0), torch.tensor(1.0)
    parts = {"rotary": _median_ms(rotary, repeats),
             "zero_grad": _median_ms(run.dp.zero_grad, repeats),
             "clip": _median_ms(lambda: clip_grad_norm(run.weights.grads(), opt.grad_clip,
                                                       run.norm_scope), repeats),
             "guard": _median_ms(lambda: run.guard.admit(1, loss, norm, report=False),
                                 repeats),
             "batch": _median_ms(lambda: run.batches.microbatches(1), repeats)}
    for p in theirs.parameters():
        p.grad = torch.zeros_like(p)
    theirs_parts = {"rotary": _median_ms(split_heads, repeats),
                    "zero_grad": _median_ms(lambda: their_opt.zero_grad(set_to_none=True),
                                            repeats),
                    "clip": _median_ms(lambda: torch.nn.utils.clip_grad_norm_(
                        theirs.parameters(), opt.grad_clip), repeats)}
    return {"rank": world.rank, "steps": {s.name: s.times for s in sides},
            "cpu": {s.name: s.cpu_times for s in sides}, "parts": parts,
            "theirs_parts": theirs_parts}


def run(model: str = "small", batch: int = 8, threads: int = 1, steps: int = 30,
        nanogpt: str | None = None, timeout: float = 1800) -> list[dict[str, Any]]:
    """One row per side, then one per breakdown part."""
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-nanogpt-") as tmp:
        source = nanogpt_source(nanogpt or os.environ.get("NANOGPT_MODEL_PY"), Path(tmp))
        args = argparse.Namespace(model=model, batch=batch, threads=threads, steps=steps,
                                  nanogpt=str(source), timeout=timeout)
        from testbed.mpiexec import clean_env

        env = clean_env({"OMP_NUM_THREADS": str(threads)})
        [result] = rankjobs.rank_results("bench.nanogpt", 1, args,
                                         ("model", "batch", "threads", "steps", "nanogpt"),
                                         env=env)
    from trainer.model.config import PRESETS

    seq = PRESETS[model].seq_len
    steps_ms = {side: [1e3 * t for t in times] for side, times in result["steps"].items()}
    base = statistics.median(steps_ms["nanogpt"])
    fastest = min(steps_ms["nanogpt"])
    cpu_ms = {side: statistics.median(times) for side, times in result["cpu"].items()}
    same = statistics.median(steps_ms["nanogpt-onednn"])
    rows: list[dict[str, Any]] = [{"side": side, "step_ms": statistics.median(ms),
                                   "ratio": statistics.median(ms) / base, "min_ms": min(ms),
                                   "min_ratio": min(ms) / fastest,
                                   "cpu_ms": 1e3 * cpu_ms[side],
                                   "cpu_ratio": cpu_ms[side] / cpu_ms["nanogpt"],
                                   "same_kernel_ratio": statistics.median(ms) / same,
                                   "same_kernel_cpu_ratio":
                                       cpu_ms[side] / cpu_ms["nanogpt-onednn"],
                                   "threads": threads,
                                   "batch": batch, "seq_len": seq, "samples_ms": ms}
                                  for side, ms in steps_ms.items()]
    for part, ms in result["parts"].items():
        theirs = result["theirs_parts"].get(part)
        rows.append({"side": f"part: {part}", "step_ms": ms,
                     "ratio": ms / base, "nanogpt_ms": theirs, "threads": threads,
                     "batch": batch, "seq_len": seq})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    common.print_rows("One-process step: dtrain vs karpathy/nanoGPT model.py (fp32, CPU); "
                      "parts: ms per step, nanoGPT's counterpart where it has one", rows,
                      SUMMARY_COLUMNS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.nanogpt", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="GPT preset")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of both sides")
    ap.add_argument("--steps", type=int, default=30, help=f"timed steps (after {WARMUP} warmup)")
    ap.add_argument("--nanogpt", help="nanoGPT's model.py (default: $NANOGPT_MODEL_PY, else "
                                      "downloaded at the pinned commit)")
    rankjobs.add_worker_options(ap, timeout=1800)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return rankjobs.main(parse_args(argv), worker, run, print_table)


if __name__ == "__main__":
    sys.exit(main())
