"""bf16 mixed precision, Megatron style (``Float16OptimizerWithFloat16Params``).

    python -m trainer.train --model tiny --precision bf16 --run-dir runs/bf16

What is bf16: the model's parameters, so every matmul, its activations, the tensors that cross
pipeline stages and the per-microbatch gradients autograd produces. What is fp32: the *main*
parameters (one fp32 copy of every parameter, which AdamW steps), the *main* gradients (the DP
buffer of `trainer.parallel.data.grad_sync`, where each bf16 microbatch gradient is accumulated in
fp32), AdamW's moments, the gradient norm and clipping, the loss and the cross-entropy softmax
(`trainer.model.precision.at_least_fp32`). The DP all-reduce runs on the fp32 main gradients, or in
bf16 with ``--grad-reduce-dtype bf16`` (half the bytes; each bucket is rounded to bf16 first).

A step: DP averages the main gradients; `MainParams.grads` hands them to the fp32 copies as
their ``.grad`` (views of the buffer, nothing copied); clipping and AdamW run on the copies;
`MainParams.publish` rounds the copies into the bf16 parameters (round to nearest even).

The model is built and initialised in fp32, checkpoints are restored into it, and only then is
it cast (`MainParams.take`), so the main weights start from the same fp32 values as an fp32 run
and a resumed run's bf16 weights are the rounding of the saved fp32 main weights, exactly as in
the uninterrupted run. A checkpoint holds the fp32 main weights as the model state and the
optimizer state of the fp32 copies: the same files, dtypes and names as an fp32 run's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from trainer.comm.protocol import Communicator
from trainer.optim.main_weights import sum_main_grad
from trainer.optim.optimizer import set_lr

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def model_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype ``--precision`` casts the model to: bf16, or None (keep the built dtype: fp32,
    or fp64 in the equivalence tests). ``auto`` is bf16 on CUDA and fp32 elsewhere (CPUs have
    no fast bf16 matmul in general)."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return None if precision == "fp32" else DTYPES[precision]


class MainParams:
    """fp32 main copies of a bf16 model's parameters and the optimizer that steps them."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 main: list[nn.Parameter]) -> None:
        self.model, self.optimizer, self.main = model, optimizer, main
        self.params = [p for p in model.parameters() if p.requires_grad]

    @classmethod
    def take(cls, model: nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype,
             build: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> MainParams:
        """Copy the fp32 ``model`` (restored, if resuming) into main parameters, move
        ``optimizer``'s state onto an optimizer ``build`` makes over them, then cast the model
        to ``dtype``. The model's parameter objects (and their TP attributes) are kept."""
        params = [p for p in model.parameters() if p.requires_grad]
        main = [nn.Parameter(p.detach().clone().float()) for p in params]
        for m, p in zip(main, params, strict=True):  # where it lies: its parameter's place
            m.placement = getattr(p, "placement", None)  # type: ignore[attr-defined]  # ours
        stepper = build(main)
        # Index-based, so the state (empty, or the checkpoint's) lands on the same parameters.
        stepper.load_state_dict(optimizer.state_dict())
        for p in params:
            p.grad = None  # DP's fp32 buffer view: a bf16 parameter gets its grad each backward
        model.to(dtype)
        return cls(model, stepper, main)

    def grads(self) -> list[nn.Parameter]:
        """The main parameters, each with its fp32 main gradient (averaged by DP) as .grad."""
        for m, p in zip(self.main, self.params, strict=True):
            m.grad = p.main_grad  # type: ignore[attr-defined]  # set by the DP sync
        return self.main

    def step(self, lr: float) -> None:
        """AdamW on the main parameters, then `publish`."""
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.publish()

    @torch.no_grad()
    def publish(self) -> None:
        """Round the stepped fp32 main parameters into the bf16 model parameters."""
        torch._foreach_copy_([p.data for p in self.params], [m.data for m in self.main])

    def sum_grad(self, param: nn.Parameter, group: Communicator) -> None:
        sum_main_grad(param, group)

    def values(self) -> list[nn.Parameter]:
        return self.main

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state with the fp32 main weights in place of the bf16 parameters."""
        main_of = {p.data_ptr(): m for p, m in zip(self.params, self.main, strict=True)}
        return {name: main_of[t.data_ptr()].detach() if t.data_ptr() in main_of else t
                for name, t in self.model.state_dict().items()}
