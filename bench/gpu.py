"""GPU validation: the numbers of the GPU path in one command, on a machine with one or more GPUs.

    python -m bench.gpu                  # on a GPU machine: all four parts below
    python -m bench.gpu --cpu-tiny       # the same script on a CPU with a tiny model (make test)
    python -m bench.gpu --json out.json  # also keep the rows

1. ``throughput`` (needs CUDA): the ``gpt-124m`` preset in bf16 at seq 1024 through dtrain's full
   path against a plain PyTorch loop of the same model (`bench.gpu_sides`), without and with
   ``--compile``, at the largest power-of-two micro-batch that fits (searched on the dtrain
   side, up to ``--max-batch``). Rows: tokens/s, MFU against the device's peak
   (`trainer.model.flops`), and dtrain / plain tokens/s (target >= 0.97; MFU >= 40% compiled).
2. ``cpu-precision``: the CPU step time of bf16 over fp32 on the dtrain path (the ``tiny``
   model), on this machine's CPU whatever else it has.
3. ``nccl-contract`` (needs CUDA and nccl4py): the Communicator contract worker of the test
   suite on the NCCL backend, one rank per GPU under ``mpiexec``; the NCCL unique id is
   broadcast over MPI for real.
4. ``launch``: ``dtrain launch --nproc-per-node <gpus>`` (2 CPU ranks in ``--cpu-tiny``)
   training the model for a few steps; the row says whether the loss fell.

Each part prints a table row; a part that cannot run here (no GPU, no nccl4py) is a row with
the reason. Exit code 1 when a part that ran failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.gpu_sides import dtrain_side, largest_batch, mesh_of_one, plain_side
from trainer.config.options import TrainConfig, make_config
from trainer.model.flops import flops_per_token, peak_tflops

REPO = Path(__file__).resolve().parent.parent
Row = dict[str, Any]


def _config(model: str, *, precision: str, batch: int, run_dir: str, compile_: bool = False,
            seq_len: int | None = None) -> TrainConfig:
    gpt = {"seq_len": seq_len} if seq_len else {}
    return make_config({"model": model, "steps": 10_000, "global_batch": batch, "dp": 1,
                        "precision": precision, "compile": compile_, "eval_every": 0,
                        "warmup_steps": 10, "data_cap_mb": 0.25 if model == "tiny" else 2.0,
                        "run_dir": run_dir}, gpt)


def throughput(world: Any, *, model: str, max_batch: int, steps: int, warmup: int,
               compiles: Sequence[bool], run_dir: str) -> list[Row]:
    """dtrain vs plain tokens/s and MFU, per compile setting."""
    device = world.device
    peak = peak_tflops(device)
    mesh = mesh_of_one(world)
    base = _config(model, precision="bf16", batch=1, run_dir=run_dir)
    batch = largest_batch(base, world, mesh, max_batch) if device.type == "cuda" else max_batch
    rows = []
    for compiled in compiles:
        cfg = base.with_options(global_batch=batch, compile=compiled)
        ours = dtrain_side(cfg, world, mesh, warmup=warmup, steps=steps)
        plain = plain_side(cfg, device, warmup=warmup, steps=steps)
        tokens = batch * cfg.gpt.seq_len
        row: Row = {"part": "throughput", "model": model, "device": _device_name(device),
                    "compile": compiled, "micro_batch": batch, "seq_len": cfg.gpt.seq_len,
                    "dtrain_tok_s": tokens / ours, "plain_tok_s": tokens / plain,
                    "ratio": plain / ours}
        for side in ("dtrain", "plain"):
            row[f"{side}_mfu"] = (row[f"{side}_tok_s"] * flops_per_token(cfg.gpt)
                                  / (peak * 1e12)) if peak else None
        rows.append(row)
    return rows


def cpu_precision(world: Any, *, steps: int, warmup: int, run_dir: str) -> Row:
    """bf16 / fp32 step time of the dtrain path on the CPU (the tiny model)."""
    from trainer.comm.mpi.communicator import MpiCommunicator

    cpu_world = replace(world, device=torch.device("cpu"),
                        comm=MpiCommunicator(world.mpi_comm.Split(world.rank, 0), "cpu"))
    mesh = mesh_of_one(cpu_world)
    times = {p: dtrain_side(_config("tiny", precision=p, batch=8, run_dir=run_dir), cpu_world,
                            mesh, warmup=warmup, steps=steps) for p in ("fp32", "bf16")}
    return {"part": "cpu-precision", "model": "tiny", "fp32_step_s": times["fp32"],
            "bf16_step_s": times["bf16"], "bf16_over_fp32": times["bf16"] / times["fp32"]}


def nccl_contract(gpus: int) -> Row:
    """The contract worker on the NCCL backend, one rank per GPU."""
    from testbed.mpiexec import PYTHON, run_mpiexec

    row: Row = {"part": "nccl-contract", "ranks": gpus}
    with tempfile.TemporaryDirectory(prefix="dtrain-nccl-") as out:
        contract = REPO / "tests" / "support" / "comm_workers" / "contract.py"
        proc = run_mpiexec(gpus, [PYTHON, str(contract),
                                  "--out", out, "--backend", "nccl"], timeout=600)
        records = [r for p in Path(out).glob("rank*.json")
                   for r in json.loads(p.read_text())["records"]]
    failed = [f"{r['case']}: {r['error']}" for r in records if not r["ok"]]
    row.update(cases=len(records), failed=len(failed), ok=proc.returncode == 0 and not failed
               and bool(records), detail="; ".join(failed[:3]) or proc.stdout[-300:].strip())
    return row


def launch(nproc: int, model: str, steps: int, seq_len: int | None) -> Row:
    """``dtrain launch --nproc-per-node N`` training run; did the loss fall?"""
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-launch-") as run_dir:
        argv = [str(Path(sys.executable).parent / "dtrain"), "launch", "--nproc-per-node",
                str(nproc), "--", sys.executable, "-m", "trainer.train", "--model", model,
                "--steps", str(steps), "--log-every", "1", "--eval-every", "0",
                "--global-batch", str(4 * nproc), "--lr", "3e-3", "--warmup-steps", "2",
                "--data-cap-mb", "1", "--run-dir", run_dir]
        argv += ["--seq-len", str(seq_len)] if seq_len else []
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines() \
            if (Path(run_dir) / "metrics.jsonl").exists() else []
    losses = [json.loads(line)["loss"] for line in lines]
    fell = len(losses) == steps and losses[-1] < losses[0]
    return {"part": "launch", "ranks": nproc, "model": model, "steps": len(losses),
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "ok": proc.returncode == 0 and fell,
            "detail": "" if proc.returncode == 0 else _tail(proc.stdout + proc.stderr)}


def run(*, cpu_tiny: bool = False, max_batch: int = 64, steps: int = 10, warmup: int = 3,
        compiles: Sequence[bool] = (False, True)) -> list[Row]:
    """Every part that can run here; `bench.run_all` calls this."""
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-gpu-") as run_dir:
        return _run(cpu_tiny=cpu_tiny, max_batch=max_batch, steps=steps, warmup=warmup,
                    compiles=compiles, run_dir=run_dir)


def _run(*, cpu_tiny: bool, max_batch: int, steps: int, warmup: int,
         compiles: Sequence[bool], run_dir: str) -> list[Row]:
    from trainer.comm.bootstrap import init

    cuda = torch.cuda.is_available() and not cpu_tiny
    if cuda and _missing_nccl4py():  # dtrain's CUDA path runs on the NCCL backend
        world = init(backend="mpi")
        why = "nccl4py is not installed: pip install 'nccl4py[cu12]'"
        return [{"part": "throughput", "skipped": why},
                cpu_precision(world, steps=steps, warmup=1, run_dir=run_dir),
                {"part": "nccl-contract", "skipped": why}, {"part": "launch", "skipped": why}]
    world = init(backend="auto" if cuda else "mpi")
    rows: list[Row] = []
    if cuda:
        rows += throughput(world, model="gpt-124m", max_batch=max_batch, steps=steps,
                           warmup=warmup, compiles=compiles, run_dir=run_dir)
    elif cpu_tiny:
        rows += throughput(world, model="tiny", max_batch=2, steps=2, warmup=1,
                           compiles=compiles, run_dir=run_dir)
    else:
        rows.append({"part": "throughput", "skipped": "no CUDA GPU here"})
    rows.append(cpu_precision(world, steps=3 if cpu_tiny else steps, warmup=1, run_dir=run_dir))
    gpus = torch.cuda.device_count() if cuda else 0
    rows.append(nccl_contract(gpus) if gpus else
                {"part": "nccl-contract", "skipped": "no CUDA GPU here"})
    rows.append(launch(gpus or 2, "gpt-124m" if gpus else "tiny", steps=30 if gpus else 4,
                       seq_len=None if gpus else 32))
    return rows


def _missing_nccl4py() -> bool:
    import importlib.util

    return importlib.util.find_spec("nccl") is None


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _tail(text: str) -> str:
    return re.sub(r"\s+", " ", text[-400:]).strip()


def format_row(row: Row) -> str:
    """One printed line per row: its fields, floats rounded."""
    def show(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
        return str(value)

    return "  ".join(f"{k}={show(v)}" for k, v in row.items())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: print every row; exit 1 when a part that ran failed."""
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--cpu-tiny", action="store_true",
                        help="tiny model on the CPU: a smoke run of every part that can run")
    parser.add_argument("--max-batch", type=int, default=64, help="micro-batch search cap")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side")
    parser.add_argument("--no-compile", action="store_true", help="skip the --compile rows")
    parser.add_argument("--json", type=Path, help="write the rows to this file")
    args = parser.parse_args(argv)
    compiles = (False,) if args.no_compile or args.cpu_tiny else (False, True)
    rows = run(cpu_tiny=args.cpu_tiny, max_batch=args.max_batch, steps=args.steps,
               compiles=compiles)
    for row in rows:
        print(format_row(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if any(row.get("ok") is False for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
