"""`make bench`: run every benchmark, print its table, keep its rows and a markdown summary.

    python -m bench.run_all [--only NAME[,NAME...]] [--quick] [--results DIR]

Benches are imported lazily, so one that is missing (still being written) or broken is
reported and the others still run. The network-namespace benches (launch_time, rendezvous,
slurm, wireup, output) need root and are skipped with the reason otherwise. Each finished
bench writes ``<results>/<name>-<UTC time>.json`` ({bench, title, options, machine, commit,
seconds, rows}: committed, one file per run, rendered into docs/performance.md by
``docs/generate.py``); then ``<results>/summary.md`` is rebuilt from the newest file of every
bench there, so ``--only`` refreshes one bench without dropping the others from the summary.
``--quick`` runs small configurations (a sanity pass, not numbers to quote). Exit code 1 when a
bench failed, 0 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import common

RESULTS = common.REPO / "bench" / "results"


@dataclass(frozen=True)
class Bench:
    """A bench module ``bench.<name>`` with ``run(**options) -> list[dict]``."""

    name: str
    title: str
    needs_root: bool = False
    full: dict[str, Any] = field(default_factory=dict)
    quick: dict[str, Any] = field(default_factory=dict)


BENCHES = (
    Bench("launch_time", "Launch time: dtrain vs mpiexec.hydra vs pdsh over SSH", True,
          quick={"hosts": (1, 2), "reps": 2}),
    Bench("rendezvous", "Rendezvous launch: dtrain agents joining vs over SSH vs torchrun c10d",
          True, quick={"hosts": (1, 2), "reps": 1}),
    Bench("launch_breakdown", "Launch start-up breakdown: imports, agent boot, first frames",
          True, quick={"hosts": (1,), "reps": 1}),
    Bench("slurm", "Launch time in a Slurm allocation: dtrain --launcher slurm vs srun", True,
          quick={"hosts": (1, 2), "reps": 1}),
    Bench("wireup", "MPI wire-up: dtrain vs mpiexec.hydra over SSH", True,
          quick={"hosts": (1, 2), "reps": 2}),
    Bench("output", "Output throughput: dtrain vs mpiexec.hydra over SSH", True,
          quick={"lines": 20000, "long": 20000, "reps": 1}),
    Bench("hosts_scale", "Launch on 8-64 namespace hosts x 1 rank: dtrain flat and tree vs "
          "mpiexec.hydra vs pdsh", True, quick={"hosts": (8,), "reps": 1}),
    Bench("sim_scale", "The head at 256-4,096 simulated hosts x 8 ranks: launch, fence, exit "
          "tail, CPU, memory, fitted growth",
          full={"budget_s": 600.0},
          quick={"sizes": (64, 256), "fidelity_hosts": 4, "rendezvous": (64,)}),
    Bench("pmi_scaling", "PMI-1 server scaling (simulated MPICH clients)",
          quick={"sizes": (64, 256)}),
    Bench("allreduce", "CPU all-reduce: dtrain MPI vs torch gloo",
          quick={"ranks": (2,), "sizes": "1K,64K,1M"}),
    Bench("ddp", "Data-parallel step: dtrain DataParallel vs torch DDP",
          quick={"ranks": (2,), "shapes": ("compute",), "model": "tiny", "steps": 3}),
    Bench("tp", "Tensor parallelism: TP=2 traffic vs analytic, step time vs DP=2 and serial",
          quick={"model": "tiny", "steps": 3}),
    Bench("pipeline", "Pipeline schedules: bubble vs theory, activation memory, step time",
          quick={"ps": (2,), "ms": (4,)}),
    Bench("progress", "Progress records: all-reduce overhead with vs without; hang to diagnosis",
          quick={"timeouts": (2.0,)}),
    Bench("flight", "torch.distributed (gloo) hangs: diagnosis time at 4/16 ranks, Flight "
          "Recorder cost per 1 MiB all-reduce, culprit-first rate per fault kind",
          quick={"ranks": (4,), "faults": 2, "rounds": 1}),
    Bench("gpu", "GPU path: gpt-124m dtrain vs plain PyTorch (on a GPU), CPU bf16/fp32 step",
          quick={"cpu_tiny": True}),
    Bench("memory", "Memory per rank (ZeRO-1 and 2, TP, PP) vs the analytic table; ZeRO cost",
          quick={"model": "tiny", "steps": 2}),
    Bench("zero3", "ZeRO-2/3 vs ZeRO-1, DDP and FSDP2: step time, bytes moved, peak memory; "
          "generation switch vs checkpoint", quick={"ranks": (2,), "n_layer": 2, "d_model": 64,
                                                    "seq_len": 32, "steps": 2}),
    Bench("plan_check", "Layout planner vs the trainer: memory, bytes per step and step time "
          "per layout", quick={"model": "tiny", "seq_len": 64, "steps": 1}),
    Bench("activations", "Activation memory: tp2 vs tp2+sp and each recompute mode",
          quick={"model": "tiny", "seq_len": 64, "steps": 2}),
    Bench("context", "Context parallelism: activation memory vs 1/cp, K/V bytes vs analytic, "
          "step time ring vs all-gather vs cp 1", quick={"seq_len": 256, "steps": 1}),
    Bench("moe", "MoE: all-to-all bytes vs analytic, step time at ep 1/2/4, all-to-all vs gloo",
          quick={"ranks": (2,), "sizes": "1M", "steps": 2}),
    Bench("llama_step", "Llama training tokens/s, one CPU process: dtrain vs transformers and "
          "torchtitan", quick={"sizes": ("tiny",), "steps": 1, "reps": 1}),
    Bench("token_loader", "Tokenized data: loader tokens/s vs training's, prepare MB/s vs "
          "tokenizers", quick={"tokens": 2_000_000, "text_mb": 1.0, "seconds": 1.0}),
    Bench("checkpoint", "Checkpoint save/load per rank: safetensors slices vs format-2 pickles, "
          "resume at other layouts", quick={"reps": 1}),
    Bench("nanogpt", "One-process step: dtrain vs karpathy/nanoGPT model.py (fp32, CPU)",
          quick={"model": "tiny", "steps": 2}),
    Bench("recovery", "Recovery time per cause (crash, host lost, hang); dtrain vs torchrun "
          "--max-restarts 1 on a rank crash", True, quick={"reps": 1}),
    Bench("goodput", "Goodput of a training run with a failure every minute (3 hosts + 1 "
          "spare)", True, quick={"minutes": 1.5, "every": 30.0}),
    Bench("sparse", "Sharded embeddings: lookups/s, all-to-all bytes vs analytic, step split, "
          "table memory per rank", quick={"rows": 100_000, "batch": 64, "steps": 2}),
    Bench("checkpoint_async", "Checkpoints: saved in the background vs in place, against the "
          "disk's dd speed; step and load time",
          quick={"configs": ("small dp2xtp2xpp2",), "steps": 4, "every": 2, "reps": 1}),
)


@dataclass(frozen=True)
class Outcome:
    name: str
    status: str            # "ok", "skipped" or "failed"
    detail: str = ""


def machine() -> dict[str, Any]:
    """Where the numbers came from; the load average says how noisy they may be."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "loadavg": list(os.getloadavg()),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def commit() -> str:
    """The commit measured (``-dirty`` with uncommitted changes), or "unknown"."""
    import subprocess

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=common.REPO, capture_output=True, text=True,
                              timeout=30, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    return (head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
            if head else "unknown")


def newest(results: Path, name: str) -> Path | None:
    """The newest result file of bench ``name``."""
    files = sorted(results.glob(f"{name}-2*.json"))
    return files[-1] if files else None


def run_bench(bench: Bench, quick: bool, results: Path) -> Outcome:
    """Import, run, print and save one bench; never raises for the bench's own failures."""
    if bench.needs_root and os.geteuid() != 0:
        return Outcome(bench.name, "skipped", "needs root for network namespaces (sudo make bench)")
    try:
        module = importlib.import_module(f"bench.{bench.name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"bench.{bench.name}":
            return Outcome(bench.name, "skipped", f"bench/{bench.name}.py is not present")
        return Outcome(bench.name, "failed", f"import failed: {exc}")
    options = dict(bench.quick if quick else bench.full)
    if "progress" in inspect.signature(module.run).parameters:
        options["progress"] = lambda line: print(f"  {bench.name}: {line}", flush=True)
    print(f"\n== {bench.name}: {bench.title}{' (quick)' if quick else ''}", flush=True)
    started, t0 = machine(), time.monotonic()
    try:
        rows = module.run(**options)
    except common.Skip as why:
        return Outcome(bench.name, "skipped", str(why))
    except Exception as exc:  # noqa: BLE001 - a broken bench must not stop the others
        traceback.print_exc()
        return Outcome(bench.name, "failed", f"{type(exc).__name__}: {exc}")
    seconds = time.monotonic() - t0
    show(module, bench, rows)
    saved = {"bench": bench.name, "title": bench.title, "quick": quick,
             "options": {k: v for k, v in options.items() if k != "progress"},
             "machine": started, "commit": commit(), "seconds": round(seconds, 1),
             "rows": rows}
    results.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    (results / f"{bench.name}-{stamp}.json").write_text(
        json.dumps(saved, indent=1, default=str) + "\n")
    return Outcome(bench.name, "ok", f"{seconds:.0f}s")


def show(module: Any, bench: Bench, rows: list[dict[str, Any]]) -> None:
    if hasattr(module, "print_table"):
        module.print_table(rows)
    else:
        common.print_rows(bench.title, rows, columns_for(module, rows))


def columns_for(module: Any, rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The module's SUMMARY_COLUMNS, else every scalar key in first-seen order."""
    if module is not None and hasattr(module, "SUMMARY_COLUMNS"):
        return list(module.SUMMARY_COLUMNS)
    keys: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if key != "bench" and not isinstance(value, (list, dict)):
                keys.setdefault(key, None)
    return [(k, k) for k in keys]


def markdown_table(rows: list[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    first = rows[0] if rows else {}
    align = [":---" if isinstance(first.get(k), str) else "---:" for _, k in columns]
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "|".join(align) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(common.fmt(row.get(k)) for _, k in columns) + " |")
    return "\n".join(lines)


def summary(results: Path, outcomes: Sequence[Outcome]) -> str:
    """summary.md from every saved result (in BENCHES order) and this run's outcomes."""
    parts = ["# Benchmark results", "",
             ("Written by `make bench` (`python -m bench.run_all`); one section per bench, "
              "from `bench/results/<name>.json`."), ""]
    for bench in BENCHES:
        path = newest(results, bench.name)
        if path is None:
            continue
        saved = json.loads(path.read_text())
        m = saved["machine"]
        module = _module_or_none(bench.name)
        parts += [f"## {bench.name}: {saved['title']}", "",
                  (f"{m['date']}, {m['cpus']} CPUs, {m['platform']}, Python {m['python']}, "
                   f"load average {m['loadavg'][0]:.1f} at start, {saved['seconds']}s"
                   f"{', quick configuration' if saved['quick'] else ''}."), "",
                  markdown_table(saved["rows"], columns_for(module, saved["rows"])), ""]
        parts += failure_notes(saved["rows"])
        if getattr(module, "SUMMARY_NOTE", None):
            parts += [module.SUMMARY_NOTE, ""]
    notes = [f"- {o.name}: {o.status}, {o.detail}" for o in outcomes if o.status != "ok"]
    if notes:
        parts += ["## Not run this time", "", *notes, ""]
    return "\n".join(parts)


def failure_notes(rows: list[dict[str, Any]]) -> list[str]:
    """A bullet per row that had failed runs (rows with an ``error``), then a blank line."""
    notes = [f"- {r.get('tool', '')} on {r.get('hosts', '?')} hosts: {r.get('ok')}/"
             f"{r.get('reps')} runs worked; first failure: {r['error']}"
             for r in rows if r.get("error")]
    return [*notes, ""] if notes else []


def _module_or_none(name: str) -> Any:
    try:
        return importlib.import_module(f"bench.{name}")
    except ImportError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated bench names: "
                    + ", ".join(b.name for b in BENCHES))
    ap.add_argument("--quick", action="store_true", help="small configurations, fast")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where JSON and summary go")
    args = ap.parse_args(argv)
    chosen = list(BENCHES)
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {b.name for b in BENCHES})
        if unknown:
            ap.error(f"unknown bench {', '.join(unknown)}; choose from "
                     + ", ".join(b.name for b in BENCHES))
        chosen = [b for b in BENCHES if b.name in wanted]
    outcomes = [run_bench(b, args.quick, args.results) for b in chosen]
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "summary.md").write_text(summary(args.results, outcomes))
    print()
    for o in outcomes:
        print(f"{o.name:<12} {o.status:<8} {o.detail}")
    print(f"results: {args.results}/")
    return 1 if any(o.status == "failed" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
