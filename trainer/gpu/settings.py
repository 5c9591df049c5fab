"""Per-device math settings: TF32 matmuls for fp32 CUDA runs, and which AdamW kernel runs.

* ``--precision fp32`` on CUDA sets ``torch.set_float32_matmul_precision("high")`` (TF32 tensor
  cores for fp32 matmuls and convolutions, ``torch.backends.cuda.matmul.allow_tf32``): about 8x
  the fp32 rate on an A100/H100 for a 10-bit mantissa inside the products, the trade Megatron
  and PyTorch's own recipes make. bf16 runs and CPUs keep the default (``"highest"``).
* AdamW is the fused single-kernel implementation on CUDA (``fused=True``: the step counters
  stay on the device, so the step never reads one on the host) and the per-tensor loop
  elsewhere: on a CPU the multi-tensor ``foreach`` kernels, which allocate their intermediates
  list by list, took 12 ms where the loop took 9 for the ``small`` model's step (one core,
  `bench.nanogpt`). Each is deterministic on a fixed device, which bit-exact resume needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: The parameter dtypes torch's fused AdamW takes.
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def configure_matmul(device: torch.device, precision: str) -> str:
    """Set the process's fp32 matmul precision for a run of ``precision`` (``fp32`` or
    ``bf16``, already resolved) on ``device``; returns what is set, for the banner."""
    if device.type == "cuda" and precision == "fp32":
        torch.set_float32_matmul_precision("high")
        return "tf32 matmuls"
    return ""


def adamw_kernel(params: Sequence[torch.Tensor]) -> dict[str, bool]:
    """AdamW's implementation flag for ``params``: fused on CUDA, the per-tensor loop
    elsewhere."""
    on_cuda = bool(params) and all(p.device.type == "cuda" and p.dtype in _FUSED_DTYPES
                                   for p in params)
    return {"fused": True} if on_cuda else {"foreach": False}
