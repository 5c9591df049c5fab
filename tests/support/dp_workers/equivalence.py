"""One DP rank of the equivalence test; returns what it saw (`tests.support.mpi_runs`).

    mpiexec -n 4 python -m tests.support.mpi_worker tests.support.dp_workers.equivalence:run OUT

For every case of `tests.support.dp_workers.cases` it trains with the trainer's own step function
(``trainer.training.run.build_run`` + ``train_step``, the code users run) and records the losses,
the bucket launch order of every step and the final parameters. Then it probes the gradient-sync
rules: no reduction inside ``no_sync()``, a parameter without gradient (refused, or with
``allow_unused`` reduced as it stands), a second backward outside ``no_sync()``, and (dp > 1)
ranks holding different models. Any unexpected exception aborts
every rank, so the test sees a failure instead of a hang.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.support.dp_workers.cases import CASES, STEPS, case_config
from tests.support.numerics import float64
from trainer.comm.bootstrap import World, init
from trainer.comm.mesh import Mesh
from trainer.comm.protocol import Communicator
from trainer.comm.topology import MeshShape
from trainer.config.options import resolve_dp
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.parallel.data.grad_sync import DataParallel, GradSyncError
from trainer.training.run import build_run
from trainer.training.step import train_step


def run_case(name: str, world: World, mesh: Mesh, out: Path) -> dict[str, Any]:
    cfg = resolve_dp(case_config(name).with_options(run_dir=str(out / name)), world.size)
    run = build_run(cfg, mesh)
    losses, orders = [], []
    for step in range(1, STEPS + 1):
        losses.append(train_step(run, step).loss)
        orders.append(list(run.dp.launch_order))
    params = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    return {"losses": losses, "orders": orders, "buckets": len(run.dp.buckets), "params": params}


def probe_no_sync(world: World, mesh: Mesh, out: Path) -> dict[str, Any]:
    """Inside no_sync nothing is launched and grads stay local; the last microbatch reduces."""
    cfg = resolve_dp(case_config("accumulation").with_options(run_dir=str(out)), world.size)
    run = build_run(cfg, mesh)
    (x0, y0), (x1, y1) = run.batches.microbatches(1)
    run.dp.zero_grad()
    with run.dp.no_sync():
        run.model.loss(x0, y0).backward()
    local = run.dp.buffer.clone()
    launched_inside = len(run.dp.launch_order)
    run.model.loss(x1, y1).backward()
    run.dp.finish_grad_sync()
    return {"launched_inside": launched_inside, "local": local,
            "synced": run.dp.buffer.clone(), "launched": list(run.dp.launch_order)}


def probe_async_paths(world: World, dp_comm: Communicator) -> dict[str, Any]:
    """The same backward reduced by every launch path: comm thread (the MPI default with a core
    to spare per rank), the backend's own async ops (what NCCL uses), and synchronously after
    backward."""
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8)
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(world.rank))
    grads = {}
    for name, kwargs in (("thread", {"comm_thread": True}), ("native", {"comm_thread": False}),
                         ("sync", {"overlap": False})):
        model = GPT(cfg, seed=3)
        dp = DataParallel(model, dp_comm, bucket_size=300, **kwargs)
        model.loss(x, x).backward()
        dp.finish_grad_sync()
        grads[name] = dp.buffer.clone()
        grads[name + "_order"] = list(dp.launch_order)
    return grads


def probe_unused(dp_comm: Communicator) -> str:
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8), seed=1)
    model.spare = nn.Linear(4, 4)  # never used by forward
    dp = DataParallel(model, dp_comm, bucket_size=500)
    x = torch.randint(0, 256, (2, 8))
    model.loss(x, x).backward()
    try:
        dp.finish_grad_sync()
    except GradSyncError as exc:
        return str(exc)
    return "no error"


def probe_allow_unused(world: World, dp_comm: Communicator) -> dict[str, Any]:
    """``allow_unused``: a layer used only in the first microbatch (inside no_sync), then, the
    next step, in none. Its input is rank + 1, so its weight's gradient is rank + 1 in every
    element and the mean over ranks (n + 1) / 2, exact in binary for n in {1, 2, 4}."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8), seed=1)
    model.spare = nn.Linear(4, 4)  # outside the model's forward: used only where told
    dp = DataParallel(model, dp_comm, bucket_size=500, allow_unused=True)
    x = torch.randint(0, 256, (2, 8))
    z = torch.full((1, 4), float(world.rank + 1))
    with dp.no_sync():
        (model.loss(x, x) + model.spare(z).sum()).backward()
    model.loss(x, x).backward()
    dp.finish_grad_sync()
    late = {n: p.grad.clone() for n, p in model.spare.named_parameters()}
    dp.zero_grad()  # the buffer still holds the reduced gradients of the step before
    model.loss(x, x).backward()
    dp.finish_grad_sync()
    idle = {n: p.grad.clone() for n, p in model.spare.named_parameters()}
    return {"late": late, "idle": idle}


def probe_second_backward(dp_comm: Communicator) -> str:
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8), seed=1)
    dp = DataParallel(model, dp_comm, bucket_size=10**9)
    x = torch.randint(0, 256, (2, 8))
    model.loss(x, x).backward()
    try:
        model.loss(x, x).backward()
    except GradSyncError as exc:
        return str(exc)
    finally:
        for bucket in dp.buckets:  # leave no request in flight for the next probe
            if bucket.handle is not None:
                bucket.handle.wait()
    return "no error"


def probe_mismatch(world: World, dp_comm: Communicator) -> str:
    model = GPT(GPTConfig(n_layer=1 + world.rank % 2, n_head=2, d_model=16, seq_len=8))
    try:
        DataParallel(model, dp_comm)
    except GradSyncError as exc:
        return str(exc)
    return "no error"


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    mesh = Mesh.build(world.comm, MeshShape(dp=world.size), world.device)
    dp_comm = mesh.group("dp")
    with float64():  # compared with an fp64 single-process reference (tests/support/numerics.py)
        result: dict[str, Any] = {name: run_case(name, world, mesh, out) for name in CASES}
    result["no_sync"] = probe_no_sync(world, mesh, out)
    result["async_paths"] = probe_async_paths(world, dp_comm)
    result["unused"] = probe_unused(dp_comm)
    result["allow_unused"] = probe_allow_unused(world, dp_comm)
    result["second_backward"] = probe_second_backward(dp_comm)
    if world.size > 1:
        result["mismatch"] = probe_mismatch(world, dp_comm)
    return result
