"""``python -m trainer.health.perf``: per-host matmul speed and pairwise all-reduce speed.

Run by ``dtrain check --perf`` (one rank per host; ``dtrain launch ... -- python -m
trainer.health.perf`` by hand). Every rank times fp32 matmuls on its device; then, for every
pair of hosts (adjacent pairs only beyond `ALL_PAIRS_MAX` hosts, to keep it O(hosts)), the two
first ranks of those hosts time all-reduces between them alone, one pair at a time so pairs
never share the network. Rank 0 prints one line, ``DTRAIN_PERF <json>``:
``{"hosts": {host: gflops}, "links": [[host_a, host_b, busbw_gbps], ...]}``; the launcher's
side judges it (`launcher.perf`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Sequence

import torch

from trainer.comm import bootstrap
from trainer.comm.bandwidth import measure_allreduce

PREFIX = "DTRAIN_PERF "
ALL_PAIRS_MAX = 16


def matmul_gflops(device: torch.device, n: int = 256, seconds: float = 0.3) -> float:
    """fp32 n x n products for about ``seconds``, through the kernel the models' linears use
    (`trainer.model.linear`: oneDNN on a CPU, about 2x MKL's ``aten::mm`` on an AMD EPYC):
    the best of a few timed batches."""
    from trainer.model.linear import linear  # the trainer's kernel, so the plan meets the step

    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == 0.0:
        start = time.perf_counter()
        for _ in range(8):
            linear(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 8 * 2 * n**3 / (time.perf_counter() - start) / 1e9)
    return best


def copy_gbps(device: torch.device, mib: int = 64, seconds: float = 0.3) -> float:
    """Memory bandwidth: copies of a ``mib`` MiB fp32 tensor for about ``seconds``, bytes read
    and written per second (the best of a few timed copies), GB/s."""
    a = torch.ones(mib * 2**18, device=device)
    b = torch.empty_like(a)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == 0.0:
        start = time.perf_counter()
        b.copy_(a)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 2 * a.nbytes / (time.perf_counter() - start) / 1e9)
    return best


def host_pairs(count: int) -> list[tuple[int, int]]:
    if count <= ALL_PAIRS_MAX:
        return [(a, b) for a in range(count) for b in range(a + 1, count)]
    return [(a, (a + 1) % count) for a in range(count)]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.health.perf", description=__doc__)
    ap.add_argument("--bytes", type=int, default=1 << 20, help="all-reduce message size")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)
    world = bootstrap.init()
    host = os.environ.get("DTRAIN_HOST") or socket.gethostname()
    gflops = matmul_gflops(world.device)
    found = world.mpi_comm.allgather((host, world.local_rank, gflops))
    hosts = list(dict.fromkeys(h for h, _, _ in found))
    first = {h: r for r, (h, local, _) in reversed(list(enumerate(found))) if local == 0}
    links = []
    for a, b in host_pairs(len(hosts)):
        pair = (first[hosts[a]], first[hosts[b]])
        inside = world.rank in pair
        sub = world.comm.split(0 if inside else 1, world.rank, name="perf")
        if inside:
            sample = measure_allreduce(sub, args.bytes, device=world.device, iters=args.iters)
            links.append([hosts[a], hosts[b], sample.busbw_gbps])
        world.comm.barrier()
    links = [link for part in world.mpi_comm.gather(links, root=0) or [] for link in part]
    if world.rank == 0:
        per_host = {h: min(g for hh, _, g in found if hh == h) for h in hosts}
        unique = {(a, b): bw for a, b, bw in links}
        print(PREFIX + json.dumps({"hosts": per_host, "links": [
            [a, b, bw] for (a, b), bw in unique.items()]}), flush=True)
    world.comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
