"""The scalars of one logged step, named as the tools users compare against name them.

torchtitan (``torchtitan/components/metrics.py``) names the loss, learning rate, gradient norm,
throughput, TFLOP/s, MFU, memory and validation loss; it never skips a step, so the count of
skipped steps takes Megatron-LM's name (``skipped_iters``, its ``megatron_training_*``
metrics). torchtitan's units are kept: MFU in percent, memory in GiB, TFLOP/s per device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: dtrain's quantity -> the name on a dashboard.
NAMES = {
    "loss": "loss_metrics/global_avg_loss",
    "lr": "lr",
    "grad_norm": "grad_norm",
    "tokens_per_s": "throughput(tps)",
    "tflops": "tflops",
    "mfu_pct": "mfu(%)",
    "memory_gib": "memory/max_active(GiB)",
    "skipped_steps": "skipped_iters",
    "val_loss": "validation_metrics/loss",
}


def scalars(record: Mapping[str, Any], *, flops_per_token: float, devices: int,
            peak_tflops: float | None, skipped_steps: int) -> dict[str, float]:
    """The dashboard scalars of one ``metrics.jsonl`` record (`StepRecord.to_json`'s fields):
    throughput per job, TFLOP/s per device, MFU when the peak is known, and the validation
    loss on steps that evaluated."""
    tps = float(record["tokens_per_s"])
    tflops = tps * flops_per_token / 1e12 / devices
    values = {"loss": float(record["loss"]), "lr": float(record["lr"]),
              "grad_norm": float(record["grad_norm"]), "tokens_per_s": tps, "tflops": tflops,
              "memory_gib": float(record.get("peak_mem_bytes") or 0) / 2**30,
              "skipped_steps": float(skipped_steps)}
    if peak_tflops:
        values["mfu_pct"] = 100.0 * tflops / peak_tflops
    if record.get("val_loss") is not None:
        values["val_loss"] = float(record["val_loss"])
    return {NAMES[key]: value for key, value in values.items()}
