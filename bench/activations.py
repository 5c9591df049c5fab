"""Activation memory and step time of sequence parallelism and each recompute mode, at tp 2.

    python -m bench.activations [--model small] [--seq-len 256] [--global-batch 8]
                                [--steps 4] [--json PATH]

Two MPI ranks (tp 2, dp 1) build one model per variant with the trainer's own ``build_run``
(``--sequence-parallel``, ``--recompute none|selective|full``) and run their steps interleaved,
the order rotating every round, so drifting load on a shared machine hits every variant alike.

Activation memory is what autograd keeps for backward: a ``saved_tensors_hooks`` pack hook
records every saved tensor's storage (parameters excluded) and a finaliser drops it when
autograd lets go, so ``act MB`` is the peak, over the step, of the live saved bytes of one
rank: the end of the forward without recompute; the block inputs plus one recomputed block
in backward with ``full``. On CUDA, ``cuda peak MB`` is ``max_memory_allocated`` over the step
above what was allocated before it. ``step ms`` is the median over timed steps of the slower
rank. Target (issue 13): activation memory with full recompute <= 1/3 of none.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import weakref
from typing import Any

from bench import rankjobs

WARMUP = 1
VARIANTS = {"tp2": {}, "tp2+sp": {"sequence_parallel": True},
            "tp2 selective": {"recompute": "selective"}, "tp2 full": {"recompute": "full"},
            "tp2+sp full": {"sequence_parallel": True, "recompute": "full"}}
SUMMARY_COLUMNS = [("variant", "variant"), ("act MB", "act_mb"), ("act vs tp2", "act_ratio"),
                   ("cuda peak MB", "cuda_peak_mb"), ("step ms", "step_ms"),
                   ("step vs tp2", "step_ratio")]
SUMMARY_NOTE = ("Activation memory is the peak of the bytes autograd holds for backward on one "
                "rank (parameters excluded), measured with saved-tensor hooks; the target is "
                "full recompute <= 1/3 of none. Sequence parallelism divides the activations "
                "outside the tensor-parallel regions by tp; selective recompute drops the "
                "attention probabilities. CPU times on a shared machine.")


class SavedActivations:
    """Peak live bytes of the tensors autograd saves for backward, parameters excluded."""

    def __init__(self, params: list[Any]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved tensors alive]
        self.now = self.peak = 0

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]

    def pack(self, t: Any) -> Any:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.skip or ptr == 0:
            return t
        if ptr not in self.live:
            self.live[ptr] = [t.untyped_storage().nbytes(), 0]
            self.now += self.live[ptr][0]
            self.peak = max(self.peak, self.now)
        self.live[ptr][1] += 1
        weakref.finalize(t, self._release, ptr)
        return t

    @staticmethod
    def unpack(t: Any) -> Any:
        return t


class Variant:
    """One model of the bench, built by the trainer."""

    def __init__(self, args: argparse.Namespace, world: Any, name: str, run_dir: str) -> None:
        from trainer.config.options import make_config
        from trainer.training.run import build_run, mesh_for

        cfg = make_config({"model": args.model, "global_batch": args.global_batch, "tp": 2,
                           "dp": 1, "steps": WARMUP + args.steps, "lr": 1e-4,
                           "warmup_steps": 1, "data_cap_mb": 1.0, "run_dir": run_dir,
                           "eval_every": 0, "precision": "fp32", **VARIANTS[name]},
                          {"seq_len": args.seq_len})
        self.run = build_run(cfg, mesh_for(cfg, world))
        self.name, self.device = name, world.device
        self.steps: list[dict[str, float]] = []

    def step(self, i: int, timed: bool) -> None:
        import torch

        from trainer.training.step import train_step

        saved = SavedActivations(list(self.run.model.parameters()))
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            train_step(self.run, i)
        if cuda:
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        if timed:
            peak = torch.cuda.max_memory_allocated(self.device) - before if cuda else None
            self.steps.append({"step_s": seconds, "act_bytes": saved.peak, "cuda_peak": peak})


def worker(args: argparse.Namespace) -> dict[str, Any]:
    from trainer.comm.bootstrap import init

    world = init(backend=args.backend)
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-act-") as tmp:
        variants = [Variant(args, world, name, f"{tmp}/{i}") for i, name in enumerate(VARIANTS)]
        rankjobs.interleave(world, variants, warmup=WARMUP, steps=args.steps)
    return {"rank": world.rank, "variants": {v.name: v.steps for v in variants}}


def _ranks(args: argparse.Namespace) -> list[dict[str, Any]]:
    return rankjobs.rank_results("bench.activations", 2, args,
                                 ("model", "seq_len", "global_batch", "steps", "backend"))


def summarize(per_rank: list[dict[str, Any]], name: str) -> dict[str, Any]:
    steps = list(zip(*(r["variants"][name] for r in per_rank), strict=True))  # [step][rank]
    med = statistics.median
    cuda = [max(r["cuda_peak"] for r in s) for s in steps if s[0]["cuda_peak"] is not None]
    return {"variant": name,
            "act_mb": max(r["act_bytes"] for s in steps for r in s) / 2**20,
            "cuda_peak_mb": max(cuda) / 2**20 if cuda else None,
            "step_ms": 1e3 * med(max(r["step_s"] for r in s) for s in steps)}


def run(**options: Any) -> list[dict[str, Any]]:
    """One row per variant, with memory and time relative to plain tp 2."""
    args = parse_args(rankjobs.as_argv(options))
    per_rank = _ranks(args)
    rows = [summarize(per_rank, name) for name in VARIANTS]
    base = rows[0]
    for row in rows:
        row["act_ratio"] = row["act_mb"] / base["act_mb"]
        row["step_ratio"] = row["step_ms"] / base["step_ms"]
        row.update(model=args.model, seq_len=args.seq_len, global_batch=args.global_batch)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    from bench import common

    r0 = rows[0]
    common.print_rows(f"Activation memory at tp 2 ({r0['model']} GPT, seq {r0['seq_len']}, "
                      f"global batch {r0['global_batch']})", rows, SUMMARY_COLUMNS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.activations", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="GPT preset")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="timed steps (after 1 warmup step)")
    ap.add_argument("--backend", default="mpi", help="mpi (CPU) or nccl (GPU)")
    rankjobs.add_worker_options(ap, timeout=900)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return rankjobs.main(parse_args(argv), worker, run, print_table)


if __name__ == "__main__":
    sys.exit(main())
