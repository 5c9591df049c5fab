"""Model FLOPs per token and MFU (model FLOPs utilisation) against the devices' peak.

    python -m trainer.train --model small --peak-tflops 1.5     # a CPU: MFU only when given

Model FLOPs per token follow PaLM (Chowdhery et al. 2022, appendix B): ``6N + 12·L·D·T``. A
token multiplies each of the N parameters once in forward (2 FLOPs, a multiply and an add) and
twice in backward (the gradients of input and weight), hence 6N; N counts every parameter a
token multiplies, so an untied embedding table (a lookup) is left out and a tied one counts
once, as the head. Attention adds ``Q·Kᵀ`` and the weighted sum of V, 2·2·T·D FLOPs per layer
and token forward, times 3 with backward: 12·L·D·T, T the context. Like PaLM the causal mask
is not halved and recomputation is not counted (those would be hardware FLOPs).

MFU = model FLOPs per second of the whole job / (peak per device × devices). The peak is
``--peak-tflops``, else the bf16 dense peak of a known GPU (`PEAK_TFLOPS`, matched in the CUDA
device name); on a CPU or an unknown GPU without ``--peak-tflops`` there is no MFU.
"""

from __future__ import annotations

import torch

from trainer.model.config import NORMS, GPTConfig

#: bf16 dense peak TFLOP/s of one GPU (vendor data sheets: H100 SXM and H200 989, A100 312).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def matmul_params(cfg: GPTConfig) -> int:
    """N: the parameters a token multiplies (the serial model's, tied embedding once, an
    untied embedding table not at all; padded vocabulary rows included, as the head
    multiplies them too)."""
    d, hidden, kv = cfg.d_model, cfg.hidden, cfg.kv_heads * cfg.head_dim
    norm = d if cfg.norm == NORMS[1] else 2 * d  # RMSNorm: weight; LayerNorm: weight, bias
    mlp = 3 if cfg.arch == "llama" else 2  # SwiGLU: gate, up, down; GELU MLP: fc, proj
    linear = 2 * d * d + 2 * d * kv + mlp * d * hidden  # q, k and v, attention proj, the MLP
    bias = (3 * d + d + hidden + d) if cfg.bias else 0
    return cfg.n_layer * (2 * norm + linear + bias) + norm + cfg.vocab_rows * d


def flops_per_token(cfg: GPTConfig) -> float:
    """Model FLOPs of forward and backward per trained token: 6N + 12·L·D·T."""
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.n_layer * cfg.d_model * cfg.seq_len


def peak_tflops(device: torch.device, given: float = 0.0) -> float | None:
    """The peak TFLOP/s of one device: ``given`` when > 0, else the table's for a known GPU,
    else None (no MFU)."""
    if given > 0:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def mfu(tokens_per_s: float, cfg: GPTConfig, peak: float, devices: int) -> float:
    """Model FLOPs utilisation (0..1) of a job of ``devices`` devices of ``peak`` TFLOP/s."""
    return tokens_per_s * flops_per_token(cfg) / (peak * 1e12 * devices)
