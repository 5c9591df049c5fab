"""``--compile``: torch.compile of every transformer block, or one clear message and eager.

    python -m trainer.train --model gpt-124m --compile

Each block's ``forward`` is replaced by its compiled version (an instance attribute, so the
parameter names and checkpoints are those of the eager model). Compilation is lazy in torch, so
a trial forward and backward of one block, on an input of the training shape, runs at start-up:
that is where a missing C++ compiler (inductor on a CPU), an unsupported GPU or a torch without
inductor fails. The verdict is reduced over the rank's groups, so either every rank compiles or
every rank runs eager, and rank 0 prints why once:

    dtrain: --compile failed [rank 0, torch.compile inductor]: <error>. Training continues with
    eager blocks; ...

The trial's backward asks only for the input's gradient, so no parameter gets a gradient and
no data-parallel hook fires. A later recompilation (a new shape, e.g. an evaluation batch)
uses the same backend that passed the trial.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

import torch
from torch import nn

from trainer.comm.protocol import Communicator, ReduceOp

_NONE = 2**62  # no rank failed


class Compilable(Protocol):
    """What `compile_blocks` uses of a model (`trainer.model.gpt.GPT` or a pipeline stage)."""

    blocks: nn.ModuleDict
    cfg: Any
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def use_plain_ops(self, plain: bool) -> None:
        """Trace-friendly plain ops in the blocks instead of fused autograd functions."""


def compile_blocks(model: Compilable, batch: int, *, world: Communicator | None = None,
                   backend: Any = "inductor") -> bool:
    """Compile the blocks of ``model`` (a `trainer.model.gpt.GPT` or pipeline stage) for
    micro-batches of ``batch`` sequences; True when compiled, False when some rank of
    ``world`` (None: this process alone) could not, and every rank runs eager. Then the lowest
    failing rank prints its error, once for the job. ``backend`` is torch.compile's
    (``--compile`` uses inductor)."""
    rank = world.rank if world is not None else 0
    blocks = list(model.blocks.values())
    model.use_plain_ops(True)  # what the tracer sees (chosen here, once)
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend)
    error = _trial(model, blocks[0], batch) if blocks else None
    first_failed = torch.tensor([rank if error else _NONE], dtype=torch.int64,
                                device=model.rope_cos.device)
    if world is not None:
        world.all_reduce(first_failed, ReduceOp.MIN)
    if int(first_failed) == _NONE:
        return True
    for block in blocks:
        del block.forward  # the class's eager forward again
    model.use_plain_ops(False)
    if int(first_failed) == rank:
        name = backend if isinstance(backend, str) else getattr(backend, "__name__", "backend")
        print(f"dtrain: --compile failed [rank {rank}, torch.compile {name}]: {error}. "
              "Training continues with eager blocks on every rank; to compile, install what "
              "the error names (e.g. a C++ compiler for CPU runs: apt-get install g++), or "
              "leave --compile off", file=sys.stderr, flush=True)
    return False


def _trial(model: Compilable, block: nn.Module, batch: int) -> str | None:
    """Forward and backward of ``block`` once; the error text, or None when it compiled."""
    cfg = model.cfg
    weight = next(block.parameters())
    x = torch.zeros(batch, cfg.seq_len, cfg.d_model, dtype=weight.dtype, device=weight.device,
                    requires_grad=True)
    try:
        out = block(x, model.rope_cos, model.rope_sin)
        (grad,) = torch.autograd.grad(out.float().sum(), [x])
        del grad
    except Exception as exc:  # noqa: BLE001 - any backend failure means: run eager
        return _describe(exc)
    return None


def _describe(exc: BaseException) -> str:
    """The error and its root cause (torch wraps a backend's error), first line of each."""
    root = exc
    # torch's BackendCompilerFailed keeps the backend's error as inner_exception
    while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
        root = inner
    text = f"{type(root).__name__}: {(str(root).strip().splitlines() or [''])[0][:300]}"
    return text if root is exc else f"{type(exc).__name__} ({text})"


