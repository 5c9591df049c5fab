"""ZeRO-2/3 against ZeRO-1, DDP and PyTorch FSDP2; the generation switch against a checkpoint.

    python -m bench.zero3 [--ranks 2,4] [--n-layer 8] [--d-model 256] [--seq-len 128]
                          [--global-batch 8] [--steps 4] [--json PATH]

One ``mpiexec`` job per world size n (dp = n, fp32, AdamW, clipping at 1.0, one microbatch,
the same GPT, batch and thread count on every side), the sides' steps interleaved (order
rotating every step, a barrier before each) so they see the same machine load:

* ``zero0`` (dtrain's DDP), ``zero1``, ``zero2``, ``zero3``: the trainer's own
  ``build_run``/``train_step``; ``fsdp2``: the same model (`trainer.model.family.build_model`)
  with ``torch.distributed.fsdp.fully_shard`` on every block and the root, over gloo, with
  ``torch.optim.AdamW`` and ``clip_grad_norm_``.
* ``step ms``: median over timed steps of the slowest rank; ``vs fsdp2`` its ratio to FSDP2's
  (ZeRO-3's target: <= 1.0); ``exposed ms``: the DP communication the step waited for
  (`trainer.comm.timing`; not measured for FSDP2).
* ``moved / P``: bytes each rank sent per step (ring algorithms: (n-1)/n of an all-gather's
  output or a reduce-scatter's input, twice that for an all-reduce; counted on every
  collective the step posted, FSDP2's gloo calls included), over the parameter bytes P, next to
  the analytic ``calc``: 2(n-1)/n for DDP and ZeRO-1/2 (reduce-scatter + all-gather), 3(n-1)/n
  for ZeRO-3 and FSDP2 (a second all-gather for backward).
* ``peak MiB`` (zero3 and fsdp2): each side alone in its own job at the same n, the growth
  of the process's peak resident set (VmHWM) from before the model is built to the end of
  the steps (the largest rank): what the model state, the gathered units and the activations
  cost, for dtrain and FSDP2 alike.
* ``switch``: at the end of the zero3 side, greedy generation of ``--gen-tokens`` bytes from
  the ZeRO-3 model switched to tp 2 and back (`trainer.inference.switch`), against saving a
  checkpoint and starting a tp 2 run from it (``build_run`` resuming at dp n/2 x tp 2) and
  sampling the same; the time of the switch (in and out; the first switch, which also
  imports what the meta model needs, shown apart) against save + load, sampling timed apart
  (the same work either way), the slowest rank; and the bytes each path holds on top
  (the switch: the TP shard plus one gathered unit; the checkpoint path: the new run's
  parameters, gradients and optimizer state).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
SIDES = ("zero0", "zero1", "zero2", "zero3", "fsdp2")
WARMUP = 1


def _config(args: argparse.Namespace, n: int, run_dir: str, **over: Any) -> Any:
    from trainer.config.options import make_config

    return make_config({"model": "tiny", "global_batch": args.global_batch, "dp": n,
                        "steps": WARMUP + args.steps + 1, "lr": 1e-4, "warmup_steps": 1,
                        "data_cap_mb": 1.0, "run_dir": run_dir, "seed": 0,
                        "precision": "fp32", "eval_every": 0, "grad_clip": 1.0,
                        "bucket_size": 250_000, **over},
                       {"n_layer": args.n_layer, "d_model": args.d_model, "n_head": 4,
                        "seq_len": args.seq_len})


class Moved:
    """Bytes this rank sends per step, counted on every collective (ring algorithms)."""

    def __init__(self) -> None:
        self.bytes = 0.0

    def install(self) -> None:
        import torch.distributed as dist

        from trainer.comm.mpi.communicator import MpiCommunicator

        def counted(cls: Any, name: str, at: int, key: str, factor: float) -> None:
            inner = getattr(cls, name)

            def wrapper(*a: Any, **kw: Any) -> Any:
                size = a[0].size if cls is MpiCommunicator else dist.get_world_size()
                t = a[at] if len(a) > at else kw[key]
                self.bytes += factor * (size - 1) / size * t.numel() * t.element_size()
                return inner(*a, **kw)

            setattr(cls, name, wrapper)

        counted(MpiCommunicator, "all_gather", 1, "out", 1.0)      # (self, out, inp)
        counted(MpiCommunicator, "reduce_scatter", 2, "inp", 1.0)  # (self, out, inp)
        counted(MpiCommunicator, "all_reduce", 1, "t", 2.0)
        counted(dist, "all_gather_single", 0, "output", 1.0)      # FSDP2's (out, inp)
        counted(dist, "reduce_scatter_single", 1, "input", 1.0)   # FSDP2's (output=, input=)
        counted(dist, "all_reduce", 0, "tensor", 2.0)

    def take(self) -> float:
        got, self.bytes = self.bytes, 0.0
        return got


class Fsdp2:
    """The same GPT under FSDP2 (gloo), stepped like the trainer's zero3 side."""

    def __init__(self, cfg: Any, world: Any) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        from trainer.model.family import build_model

        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:"
                                    f"{os.environ['BENCH_PORT']}", rank=world.rank,
                                    world_size=world.size)
        torch.manual_seed(cfg.seed)
        self.model = build_model(cfg.gpt)
        for block in self.model.blocks.values():
            fully_shard(block)
        fully_shard(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.optimizer.lr)
        b = cfg.data.global_batch // cfg.parallel.dp
        gen = torch.Generator().manual_seed(world.rank)
        self.x = torch.randint(0, cfg.gpt.vocab_size, (b, cfg.gpt.seq_len), generator=gen)
        self.y = torch.randint(0, cfg.gpt.vocab_size, (b, cfg.gpt.seq_len), generator=gen)
        self.clip = cfg.optimizer.grad_clip

    def step(self) -> float:
        import torch

        # Through forward (FSDP2's root hooks), not GPT.loss, which skips it.
        logits = self.model(self.x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), self.y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad()
        return 0.0


def _trainer_side(args: argparse.Namespace, world: Any, name: str, run_dir: str) -> Any:
    from trainer.training.run import build_run, mesh_for

    cfg = _config(args, world.size, run_dir, zero=int(name[-1]))
    return build_run(cfg, mesh_for(cfg, world))


def _step(side: Any, step: int) -> float:
    if isinstance(side, Fsdp2):
        return side.step()
    from trainer.training.step import train_step

    return train_step(side, step).comm_exposed_s


@contextmanager
def _shared_dir(args: argparse.Namespace, world: Any) -> Iterator[str]:
    """The run folders of this job, one for every rank (under the job's --out)."""
    path = Path(args.out, "runs")
    yield str(path)
    world.comm.barrier()
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def timing_worker(args: argparse.Namespace) -> dict[str, Any]:
    from trainer.comm.bootstrap import init

    world = init(backend="mpi")
    moved = Moved()
    moved.install()
    out: dict[str, Any] = {"rank": world.rank}
    with _shared_dir(args, world) as tmp:
        sides = {name: (Fsdp2(_config(args, world.size, tmp), world) if name == "fsdp2"
                        else _trainer_side(args, world, name, f"{tmp}/{name}"))
                 for name in SIDES}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in SIDES}
        order = list(SIDES)
        for i in range(1, WARMUP + args.steps + 1):
            for name in order[i % len(order):] + order[:i % len(order)]:
                world.comm.barrier()
                moved.take()
                start = time.perf_counter()
                exposed = _step(sides[name], i)
                took = time.perf_counter() - start
                if i > WARMUP:
                    runs[name].append({"step_s": took, "exposed_s": exposed,
                                       "moved": moved.take()})
        out["steps"] = runs
        out["param_bytes"] = 4 * sum(p.numel() for p in sides["zero0"].model.parameters())
        out["switch"] = _switch(args, world, sides["zero3"], tmp)
    return out


def _switch(args: argparse.Namespace, world: Any, run: Any, tmp: str) -> dict[str, Any]:
    """The generation switch against save + load at tp 2, each timed and its bytes held."""
    from trainer.inference.sampling import sample_ids
    from trainer.inference.switch import tp_generation
    from trainer.parallel.tensor.random import TP_RNG
    from trainer.parallel.zero.memory import held_bytes
    from trainer.training.checkpointing import save_checkpoint
    from trainer.training.run import build_run, mesh_for

    prompt = list(b"def main(")
    units = run.weights.units
    times = []
    for _ in range(2):  # the first also imports what building a meta model needs (once)
        world.comm.barrier()
        start = time.perf_counter()
        units.peak_gathered_bytes = 0
        with tp_generation(run.model, units, 2) as gen:
            entered = time.perf_counter()
            shard = sum(p.numel() * p.element_size() for p in gen.parameters())
            ids = sample_ids(gen, prompt, tokens=args.gen_tokens, temperature=0)
            sampled = time.perf_counter()
            del gen
        times.append((entered - start + time.perf_counter() - sampled, sampled - entered))
    (cold_s, _), (switch_s, sample_s) = times
    on_top = shard + units.peak_gathered_bytes
    world.comm.barrier()
    start = time.perf_counter()
    save_checkpoint(run, WARMUP + args.steps)
    cfg = run.cfg.with_options(tp=2, dp=world.size // 2, zero=1, resume=True)
    loaded = build_run(cfg, mesh_for(cfg, world))
    loaded.tracker.seed(TP_RNG, 0)  # the trainer seeds it every step; eval draws nothing
    head = loaded.model.head
    head.gather_output, loaded.model.vocab_start = True, 0
    ckpt_s = time.perf_counter() - start
    ids_ckpt = sample_ids(loaded.model.eval(), prompt, tokens=args.gen_tokens, temperature=0)
    held = held_bytes(loaded.model.parameters(), loaded.dp.buffer, loaded.weights.optimizer)
    return {"switch_s": switch_s, "cold_s": cold_s, "ckpt_s": ckpt_s, "sample_s": sample_s,
            "switch_bytes": on_top, "ckpt_bytes": held.total, "same_tokens": ids == ids_ckpt}


def rss_worker(args: argparse.Namespace) -> dict[str, Any]:
    """One side alone: the growth of peak RSS from before the model is built."""
    from trainer.comm.bootstrap import init
    from trainer.parallel.zero.memory import PeakMemory, _vm_hwm

    world = init(backend="mpi")
    peak = PeakMemory(world.device)
    base = _vm_hwm()
    peak.take()
    with _shared_dir(args, world) as tmp:
        side = Fsdp2(_config(args, world.size, tmp), world) if args.side == "fsdp2" \
            else _trainer_side(args, world, args.side, f"{tmp}/{args.side}")
        for i in range(1, WARMUP + args.steps + 1):
            _step(side, i)
        return {"rank": world.rank, "peak_growth": _vm_hwm() - base}


def _job(n: int, args: argparse.Namespace, *extra: str) -> list[dict[str, Any]]:
    sys.path.insert(0, str(REPO))
    from bench.allreduce import _free_port
    from testbed.mpiexec import clean_env, run_mpiexec

    with tempfile.TemporaryDirectory(prefix="dtrain-bench-zero3-out-") as out:
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("n_layer", "d_model", "seq_len", "global_batch", "steps",
                          "gen_tokens")]
        env = clean_env({"BENCH_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"})
        proc = run_mpiexec(n, [sys.executable, "-m", "bench.zero3", "--out", out, *extra,
                               *flags], timeout=args.timeout, env=env)
        files = sorted(Path(out).glob("rank*.json"))
        if proc.returncode != 0 or len(files) != n:
            raise RuntimeError(f"bench.zero3 {extra} on {n} ranks failed:\n"
                               f"{proc.stdout[-3000:]}")
        return [json.loads(f.read_text()) for f in files]


def run(**options: Any) -> list[dict[str, Any]]:
    """One row per (world size, side)."""
    args = parse_args([f"--{k.replace('_', '-')}={v}" for k, v in options.items()])
    rows = []
    med = statistics.median
    for n in args.ranks:
        got = _job(n, args, "--worker=timing")
        peaks = {side: max(r["peak_growth"] for r in _job(n, args, "--worker=rss",
                                                          f"--side={side}")) / MIB
                 for side in ("zero3", "fsdp2")}
        p = got[0]["param_bytes"]
        ms = {side: 1e3 * med(max(r["steps"][side][k]["step_s"] for r in got)
                              for k in range(args.steps)) for side in SIDES}
        for side in SIDES:
            row: dict[str, Any] = {"side": side, "ranks": n, "step_ms": ms[side],
                                   "vs_fsdp2": ms[side] / ms["fsdp2"],
                                   "exposed_ms": 1e3 * med(max(r["steps"][side][k]["exposed_s"]
                                                               for r in got)
                                                           for k in range(args.steps)),
                                   "moved_per_p": max(med(s["moved"] for s in r["steps"][side])
                                                      for r in got) / p,
                                   "calc_per_p": (3 if side in ("zero3", "fsdp2") else 2)
                                   * (n - 1) / n,
                                   "peak_mib": peaks.get(side)}
            if side == "fsdp2":
                row["exposed_ms"] = None  # not measured: FSDP2's waits are inside torch
            if side == "zero3":
                sw = [r["switch"] for r in got]
                row.update(switch_s=max(s["switch_s"] for s in sw),
                           ckpt_s=max(s["ckpt_s"] for s in sw),
                           cold_s=max(s["cold_s"] for s in sw),
                           sample_s=max(s["sample_s"] for s in sw),
                           switch_mib=max(s["switch_bytes"] for s in sw) / MIB,
                           ckpt_mib=max(s["ckpt_bytes"] for s in sw) / MIB,
                           same_tokens=all(s["same_tokens"] for s in sw))
                row["switch_speedup"] = row["ckpt_s"] / row["switch_s"]
            row.update(n_layer=args.n_layer, d_model=args.d_model, seq_len=args.seq_len,
                       gen_tokens=args.gen_tokens,
                       global_batch=args.global_batch, param_mib=p / MIB,
                       loadavg=list(os.getloadavg()))
            rows.append(row)
    return rows


COLUMNS = [("side", "side"), ("ranks", "ranks"), ("step ms", "step_ms"),
           ("vs fsdp2", "vs_fsdp2"), ("exposed ms", "exposed_ms"), ("moved / P", "moved_per_p"),
           ("calc", "calc_per_p"), ("peak MiB", "peak_mib")]


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    r0 = rows[0]
    table = Table(title=f"ZeRO-2/3 vs ZeRO-1, DDP and FSDP2, fp32 CPU ({r0['n_layer']} blocks, "
                        f"d {r0['d_model']}, {r0['param_mib']:.1f} MiB of parameters)")
    for head, _ in COLUMNS:
        table.add_column(head, justify="right")
    for row in rows:
        table.add_row(*(f"{row[k]:.2f}" if isinstance(row[k], float) else
                        "-" if row[k] is None else str(row[k]) for _, k in COLUMNS))
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)
    for row in rows:
        if "switch_s" in row:
            console.print(
                f"dp {row['ranks']}: generation switch to tp 2 {row['switch_s']:.2f} s (first "
                f"{row['cold_s']:.2f} s) "
                f"(+{row['switch_mib']:.1f} MiB) vs save + load at tp 2 {row['ckpt_s']:.2f} s "
                f"(+{row['ckpt_mib']:.1f} MiB): {row['switch_speedup']:.1f}x faster; "
                f"same tokens: {row['same_tokens']}; sampling {args_tokens(row)} tokens "
                f"{row['sample_s']:.2f} s either way")


def args_tokens(row: dict[str, Any]) -> int:
    return int(row["gen_tokens"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.zero3", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=lambda s: [int(x) for x in str(s).strip("()[] ").split(",")
                                               if x.strip()], default=[2, 4])
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="timed steps (after 1 warmup step)")
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--worker", choices=("timing", "rss"), help=argparse.SUPPRESS)
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    from bench import common

    if args.worker:
        work = timing_worker if args.worker == "timing" else rss_worker
        return common.save_rank_result(args.out, work(args))
    options = {k: v for k, v in vars(args).items()
               if k not in ("json", "worker", "out", "side")}
    options["ranks"] = ",".join(map(str, options["ranks"]))
    return common.report(run(**options), print_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
