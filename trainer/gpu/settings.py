"""Per-device settings: TF32 matmuls for fp32 CUDA runs, which AdamW kernel runs, and how a
CPU run's process keeps the memory it frees.

* ``--precision fp32`` on CUDA sets ``torch.set_float32_matmul_precision("high")`` (TF32 tensor
  cores for fp32 matmuls and convolutions, ``torch.backends.cuda.matmul.allow_tf32``): about 8x
  the fp32 rate on an A100/H100 for a 10-bit mantissa inside the products, the trade Megatron
  and PyTorch's own recipes make. bf16 runs and CPUs keep the default (``"highest"``).
* AdamW is torch's fused single-kernel implementation (``fused=True``) on CUDA and on CPUs: on
  CUDA the step counters stay on the device, so the step never reads one on the host; on a CPU
  one vectorised pass over each tensor took 0.15 s where the per-tensor loop took 0.78 s and
  the multi-tensor ``foreach`` kernels 0.97 s for a 100M-parameter Llama's tensors (one thread,
  2026-11-27). It is elementwise and deterministic on a fixed device, which bit-exact resume
  needs, and gives the same bits however the elements are split into tensors, so ZeRO-1's
  flat-buffer pieces step exactly as whole parameters do. Other devices or dtypes take the
  per-tensor loop.
* fp32 linears on a CPU multiply through oneDNN rather than torch's MKL ``aten::mm`` (the
  models' own choice, `trainer.model.linear`: about 2.2x the GFLOP/s on this AMD EPYC).
* A CPU run keeps the memory it frees for its next step (`keep_freed_memory`): by default
  glibc gives blocks from 128 KiB up (a threshold it raises to at most 32 MiB) back to the
  kernel when they are freed, so every step faulted its activations and gradients in again,
  page by page: about 5,000 page faults per step of the ``llama-tiny`` shape and 150,000 of a
  100M Llama (batch 4 x 256). Served from a heap that is never trimmed, the same steps took
  36-37 ms instead of 43-47 (one thread) and 6.48 s instead of 6.66 s, with 68 and 4,500
  faults, at a peak resident size within 1.5% (torchtitan's Llama in a plain loop, 2026-11-27).
  The process's resident memory then stays at its peak, as a training step's does anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Sequence

import torch

#: The parameter dtypes torch's fused AdamW takes, per device type.
_FUSED_DTYPES = {"cuda": (torch.float32, torch.bfloat16, torch.float16),
                 "cpu": (torch.float64, torch.float32, torch.bfloat16, torch.float16)}

#: glibc's mallopt parameters (malloc.h) and the size up to which the heap serves allocations.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_HEAP_SERVES = 1 << 30


def keep_freed_memory(device: torch.device) -> bool:
    """On a CPU run under glibc: serve allocations below 1 GiB from the heap and never trim it,
    so a step reuses the pages the previous one freed. False where nothing is set (another
    device, or a C library without ``mallopt``)."""
    if device.type != "cpu":
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _HEAP_SERVES)
                and mallopt(_M_TRIM_THRESHOLD, 2 * _HEAP_SERVES))


def configure_matmul(device: torch.device, precision: str) -> str:
    """Set the process's fp32 matmul precision for a run of ``precision`` (``fp32`` or
    ``bf16``, already resolved) on ``device``; returns what is set, for the banner."""
    if device.type == "cuda" and precision == "fp32":
        torch.set_float32_matmul_precision("high")
        return "tf32 matmuls"
    return ""


def adamw_kernel(params: Sequence[torch.Tensor]) -> dict[str, bool]:
    """AdamW's implementation flag for ``params``: fused when they all sit on one kind of
    device whose fused kernel takes their dtypes (CUDA, CPU), else the per-tensor loop."""
    kinds = {p.device.type for p in params}
    fused = len(kinds) == 1 and all(p.dtype in _FUSED_DTYPES.get(p.device.type, ())
                                    for p in params)
    return {"fused": True} if fused else {"foreach": False}
