"""Context parallelism: activation memory, bytes exchanged and step time at cp 1, 2 and 4.

    python -m bench.context [--model llama-tiny] [--seq-len 4096] [--steps 2] [--json PATH]

Four MPI ranks. Every variant trains the same global batch (one sequence of ``--seq-len``
tokens) with the trainer's own ``build_run``: cp 1 on rank 0 alone (the others wait), cp 2 on
ranks 0-1 and cp 4 on all four, each cp > 1 with the ring and with the all-gather exchange
(`trainer.parallel.context`). So the global tokens are equal and each rank's share is 1/cp.

* ``act MB``: the peak, over a step, of what autograd keeps for backward on one rank
  (saved-tensor hooks, parameters excluded: `bench.activations.SavedActivations`), against the
  analytic ``cp 1 / cp`` (every saved tensor is per token: the attention keeps q, k, v, its
  output and the log-sum-exp, never a T x T matrix, in both the serial kernel and the blocks).
* ``KV MB/layer``: bytes one rank sends per layer and step through the cp group, counted at the
  communicator (a send of ``batch_p2p`` as its bytes; an all-gather or reduce-scatter of n
  bytes over cp ranks as the (cp-1)/cp x n a ring algorithm sends), forward and backward,
  against the analytic: forward 2 x (cp-1)/cp x |K| for both exchanges (|K| = the whole
  sequence's keys, |V| = |K|); backward the K/V again plus the dK/dV in the accumulation dtype
  (ring: cp hops of a block, the last one home; all-gather: a reduce-scatter).
* ``step ms``: median over timed steps of the slowest rank (CPU, shared machine: read with
  the load average in the JSON).
* ``longest seq``: the sequence whose activations would fill ``--budget-mb`` per rank at the
  measured bytes per token (linear in T: see ``act MB``) plus the attention's largest transient
  (`longest`: none on the CPU, where every kernel is fused and tiled).
* ``trained``, ``trained act MB`` (``--train-longest 1``): that sequence then trained, one step
  after a warm-up, at cp 1 and cp 4 (all-gather), and the activation peak it measured per rank:
  within the budget when the estimate holds. A budget of tens of MB keeps the cp 4 step to a
  minute on this CPU; the machine's whole memory would take hours a step.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from typing import Any

from bench import rankjobs
from bench.activations import SavedActivations

WARMUP = 1
VARIANTS: dict[str, dict[str, Any]] = {
    "cp1": {"cp": 1}, "cp2 ring": {"cp": 2, "cp_comm": "ring"},
    "cp2 allgather": {"cp": 2, "cp_comm": "allgather"}, "cp4 ring": {"cp": 4, "cp_comm": "ring"},
    "cp4 allgather": {"cp": 4, "cp_comm": "allgather"}}
SUMMARY_COLUMNS = [("variant", "variant"), ("act MB/rank", "act_mb"),
                   ("analytic", "act_analytic_mb"), ("act vs analytic", "act_vs_analytic"),
                   ("KV MB/layer fwd", "fwd_mb"), ("analytic fwd", "fwd_analytic_mb"),
                   ("KV MB/layer bwd", "bwd_mb"), ("analytic bwd", "bwd_analytic_mb"),
                   ("step ms", "step_ms"), ("step vs cp1", "step_ratio"),
                   ("longest seq", "longest_seq"), ("trained", "trained_seq"),
                   ("trained act MB", "trained_act_mb")]
TRAINED = ("cp1", "cp4 allgather")  # the variants --train-longest trains at their longest
SUMMARY_NOTE = ("One sequence per step at every cp (equal global tokens), four MPI ranks on a "
                "shared CPU. Activation memory per rank is the peak of autograd's saved bytes; "
                "the analytic column is cp 1's divided by cp. Bytes are what one rank sends per "
                "layer through the cp group. The longest sequence fills the memory budget per "
                "rank at the measured bytes per token.")


class Counting:
    """A communicator that counts the bytes this rank sends (see the module), then delegates."""

    def __init__(self, inner: Any, tally: dict[str, int]) -> None:
        self.inner, self.tally, self.phase = inner, tally, "fwd"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _add(self, n: int) -> None:
        self.tally[self.phase] = self.tally.get(self.phase, 0) + n

    def batch_p2p(self, ops: Any) -> Any:
        self._add(sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                      if op.kind == "send"))
        return self.inner.batch_p2p(ops)

    def all_gather(self, out: Any, inp: Any, **kw: Any) -> Any:
        self._add(inp.numel() * inp.element_size() * (self.inner.size - 1))
        return self.inner.all_gather(out, inp, **kw)

    def reduce_scatter(self, out: Any, inp: Any, **kw: Any) -> Any:
        self._add(inp.numel() * inp.element_size() * (self.inner.size - 1) // self.inner.size)
        return self.inner.reduce_scatter(out, inp, **kw)


class Variant:
    """One layout of the bench, built by the trainer on the first ``cp`` ranks."""

    def __init__(self, args: argparse.Namespace, world: Any, subs: dict[int, Any], name: str,
                 run_dir: str) -> None:
        from trainer.comm.mesh import Mesh
        from trainer.config.options import make_config, resolve_dp
        from trainer.training.run import build_run

        options = VARIANTS[name]
        self.cp, self.name, self.device, self.world = options["cp"], name, world.device, world
        self.steps: list[dict[str, Any]] = []
        self.run = None
        if world.rank >= self.cp:
            return
        cfg = resolve_dp(make_config(
            {"model": args.model, "global_batch": 1, "steps": WARMUP + args.steps, "lr": 1e-4,
             "warmup_steps": 1, "data_cap_mb": 1.0, "run_dir": run_dir, "eval_every": 0,
             "precision": "fp32", "seq_len": args.seq_len, **options}), self.cp)
        self.run = build_run(cfg, Mesh.build(subs[self.cp], cfg.parallel.mesh(), world.device))
        self.tally: dict[str, int] = {}
        self.layers = len(list(self.run.model.layers()))
        if self.cp > 1:
            core = next(b for _, b in self.run.model.layers()).attn.core
            self.counter = Counting(core.comm, self.tally)
            counted = dataclasses.replace(core, comm=self.counter)
            for _, block in self.run.model.layers():
                block.attn.core = counted
                # what the cp group sends after the first block's backward starts is backward's
                block.register_full_backward_pre_hook(self._to_backward)

    def step(self, i: int, timed: bool) -> None:
        import torch

        from trainer.training.step import train_step

        if self.run is None:
            return
        saved = SavedActivations(list(self.run.model.parameters()))
        self.tally.clear()
        if self.cp > 1:
            self.counter.phase = "fwd"
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            train_step(self.run, i)
        seconds = time.perf_counter() - start
        if timed:
            self.steps.append({"step_s": seconds, "act_bytes": saved.peak,
                               "fwd": self.tally.get("fwd", 0), "bwd": self.tally.get("bwd", 0)})

    def _to_backward(self, module: Any, grad: Any) -> None:
        self.counter.phase = "bwd"


def worker(args: argparse.Namespace) -> dict[str, Any]:
    from trainer.comm.bootstrap import init

    world = init(backend=args.backend)
    subs = {n: world.comm.split(int(world.rank >= n), world.rank, name=f"first{n}")
            for n in (1, 2, 4)}
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-cp-") as tmp:
        variants = [Variant(args, world, subs, name, f"{tmp}/{i}")
                    for i, name in enumerate(VARIANTS) if name in args.variants.split(",")]
        rankjobs.interleave(world, variants, warmup=WARMUP, steps=args.steps)
        layers = variants[0].layers if variants[0].run is not None else 0
    return {"rank": world.rank, "layers": layers,
            "variants": {v.name: v.steps for v in variants}}


def kv_bytes(model: str, seq_len: int) -> tuple[int, int]:
    """(|K| of the whole sequence per layer in fp32, the K/V head dim x heads) for one
    sequence: keys of every key/value head at every position."""
    from trainer.config.options import make_config

    gpt = make_config({"model": model, "seq_len": seq_len}).gpt
    width = gpt.kv_heads * gpt.head_dim
    return 4 * seq_len * width, width


def analytic_bytes(cp: int, comm: str, k_bytes: int) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends per layer (module docstring); dK/dV travel in
    fp32, the accumulation dtype of an fp32 model."""
    if cp == 1:
        return 0.0, 0.0
    share = (cp - 1) / cp
    forward = 2 * share * k_bytes
    grads = 2 * k_bytes * (1.0 if comm == "ring" else share)  # cp hops vs a reduce-scatter
    return forward, forward + grads


def _heads(model: str) -> int:
    from trainer.config.options import make_config

    return make_config({"model": model}).gpt.n_head


def longest(saved_per_token: float, cp: int, heads: int, budget: float, *,
            fused: bool = True) -> int:
    """The longest sequence (a multiple of 64) whose saved activations per rank plus the
    largest transient of its attention fit ``budget`` bytes: the fused kernels (cp 1's, and
    the blocks' on the CPU) work in tiles, no T x T; the plain block path (``fused`` False:
    other devices) materialises a block's scores, probabilities and their exponent, 3 x heads
    x c² fp32 with c = T / (2 cp) (`trainer.parallel.context.blocks`)."""
    a = 0.0 if cp == 1 or fused else 3 * heads * 4 / (2 * cp) ** 2  # bytes per T²
    t = budget / saved_per_token if a == 0 else \
        (-saved_per_token + (saved_per_token ** 2 + 4 * a * budget) ** 0.5) / (2 * a)
    return int(t) // 64 * 64


def summarize(per_rank: list[dict[str, Any]], name: str) -> dict[str, Any]:
    cp = VARIANTS[name]["cp"]
    ranks = per_rank[:cp]
    steps = list(zip(*(r["variants"][name] for r in ranks), strict=True))  # [step][rank]
    layers = per_rank[0]["layers"]
    return {"variant": name, "cp": cp, "exchange": VARIANTS[name].get("cp_comm", ""),
            "act_mb": max(r["act_bytes"] for s in steps for r in s) / 2**20,
            "fwd_mb": max(r["fwd"] for s in steps for r in s) / layers / 2**20,
            "bwd_mb": max(r["bwd"] for s in steps for r in s) / layers / 2**20,
            "step_ms": 1e3 * statistics.median(max(r["step_s"] for r in s) for s in steps)}


def run(**options: Any) -> list[dict[str, Any]]:
    """One row per variant: memory, bytes and time against cp 1 and the analytic figures."""
    args = parse_args(rankjobs.as_argv(options))
    passed = ("model", "seq_len", "steps", "backend", "variants")
    per_rank = rankjobs.rank_results("bench.context", 4, args, passed)
    rows = [summarize(per_rank, name) for name in VARIANTS]
    base = rows[0]
    k_bytes, _ = kv_bytes(args.model, args.seq_len)
    heads = _heads(args.model)
    for row in rows:
        fwd, bwd = analytic_bytes(row["cp"], row["exchange"], k_bytes)
        row["act_analytic_mb"] = base["act_mb"] / row["cp"]
        row["act_vs_analytic"] = row["act_mb"] / row["act_analytic_mb"]
        row["fwd_analytic_mb"], row["bwd_analytic_mb"] = fwd / 2**20, bwd / 2**20
        row["step_ratio"] = row["step_ms"] / base["step_ms"]
        row["longest_seq"] = longest(row["act_mb"] * 2**20 / args.seq_len, row["cp"],
                                     heads, args.budget_mb * 2**20)
        row.update(model=args.model, seq_len=args.seq_len, budget_mb=args.budget_mb)
        if args.train_longest and row["variant"] in TRAINED:
            at = argparse.Namespace(**{**vars(args), "seq_len": row["longest_seq"], "steps": 1,
                                       "variants": row["variant"]})
            trained = summarize(rankjobs.rank_results("bench.context", 4, at, passed),
                                row["variant"])
            row.update(trained_seq=row["longest_seq"], trained_act_mb=trained["act_mb"])
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    from bench import common

    r0 = rows[0]
    common.print_rows(f"Context parallelism ({r0['model']}, one sequence of {r0['seq_len']} "
                      f"tokens per step, budget {r0['budget_mb']} MB per rank)", rows,
                      SUMMARY_COLUMNS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.context", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-tiny", help="model preset (tiny: GPT)")
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens of the one sequence")
    ap.add_argument("--steps", type=int, default=2, help="timed steps (after 1 warmup step)")
    ap.add_argument("--budget-mb", type=float, default=4096.0,
                    help="activation memory per rank the longest sequence may fill")
    ap.add_argument("--backend", default="mpi", help="mpi (CPU) or nccl (GPU)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated variants to run (default: all)")
    ap.add_argument("--train-longest", type=int, choices=(0, 1), default=0,
                    help="1: then train cp 1 and cp 4 at their longest sequence for the budget")
    rankjobs.add_worker_options(ap, timeout=1800)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return rankjobs.main(parse_args(argv), worker, run, print_table)


if __name__ == "__main__":
    sys.exit(main())
