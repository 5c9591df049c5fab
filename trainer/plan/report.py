"""What `python -m trainer.plan` prints: a ranked table of layouts (or JSON), the cost model's
assumptions, and the layouts the trainer refuses with its reasons."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from typing import Any

from trainer.errors import ConfigError
from trainer.plan.cluster import Cluster
from trainer.plan.estimate import ASSUMPTIONS, Estimate

GIB = 2**30


def row(e: Estimate) -> dict[str, Any]:
    """One layout as data (the JSON rows)."""
    par = e.config.parallel
    return {"layout": e.layout, "dp": par.dp, "tp": par.tp, "pp": par.pp, "cp": par.cp,
            "ep": par.ep,
            "zero": e.config.optimizer.zero, "sequence_parallel": par.sequence_parallel,
            "recompute": par.recompute, "microbatches": par.microbatches,
            "micro_batch": e.config.micro_batch, "fits": e.fits, "why": e.why,
            "memory_bytes": {**asdict(e.memory), "total": e.memory.total},
            "comm_bytes_per_step": asdict(e.comm), "step_s": e.step_s, "mfu": e.mfu}


def as_json(done: list[Estimate], refused: list[ConfigError], cluster: Cluster) -> str:
    return json.dumps({"cluster": {**asdict(cluster), "gpus": cluster.gpus},
                       "assumptions": ASSUMPTIONS, "layouts": [row(e) for e in done],
                       "refused": sorted({str(r) for r in refused})}, indent=1)


def as_table(done: list[Estimate], refused: list[ConfigError], cluster: Cluster, *,
             top: int) -> str:
    """The best ``top`` layouts, fitting ones first, with what does not fit and why."""
    unit, size = ("GiB", GIB) if any(e.memory.total >= GIB for e in done) else ("MiB", 2**20)
    head = (f"{'#':>3}  {'layout':<42} {unit + '/GPU':>8} {'params':>7} {'grads':>7} {'optim':>7} "
            f"{'activ':>7} {'comm GB':>8} {'step s':>8} {'MFU':>6}  fits")
    lines = [f"plan for {cluster.hosts} x {cluster.gpus_per_host} {cluster.name} "
             f"({cluster.gpu.memory_bytes / GIB:.0f} GiB, {cluster.gpu.peak_flops / 1e12:.0f} "
             f"TFLOP/s each): {len(done)} layouts, {sum(e.fits for e in done)} fit", head]
    for i, e in enumerate(done[:top], 1):
        m = e.memory
        gb = e.comm.total / 1e9
        lines.append(f"{i:>3}  {e.layout:<42} {m.total / size:>8.1f} {m.params / size:>7.1f} "
                     f"{m.grads / size:>7.1f} {m.optimizer / size:>7.1f} "
                     f"{m.activations / size:>7.1f} {gb:>8.2f} {e.step_s:>8.3f} "
                     f"{100 * e.mfu:>5.1f}%  {'yes' if e.fits else 'no: ' + e.why}")
    lines.append(f"cost model: {ASSUMPTIONS}")
    gpu = cluster.gpu
    lines.append(f"cluster numbers: memory bandwidth {gpu.memory_bw / 1e9:.0f} GB/s, "
                 f"{1e6 * gpu.op_s:.1f} us per operation (host "
                 f"{'overlapped' if gpu.host_overlaps else 'added'}), links "
                 f"{cluster.intra_bw / 1e9:.1f} / {cluster.inter_bw / 1e9:.1f} GB/s and "
                 f"{1e6 * cluster.intra_latency_s:.1f} / {1e6 * cluster.inter_latency_s:.1f} us "
                 "per message step inside / between hosts")
    reasons = Counter(f"{r.what}: {r.why}" for r in refused)
    for reason, count in reasons.most_common(5):
        lines.append(f"refused by the trainer ({count} layouts): {reason}")
    return "\n".join(lines)
