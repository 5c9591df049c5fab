"""The plain GPT (or one pipeline stage of it) on the meta device: shapes, names, no memory."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from trainer.model.config import GPTConfig
from trainer.model.family import build_model
from trainer.model.gpt import GPT
from trainer.parallel.pipeline.partition import StageLayout
from trainer.parallel.pipeline.stages import build_stage_model


class _SkipInitOnMeta(TorchFunctionMode):
    """Turns ``torch.nn.init`` initialisers on meta tensors into no-ops: the tensors have no
    data, and on meta they run Python reference kernels that import ``torch._dynamo`` (seconds
    of CPU per rank)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        if (getattr(func, "__module__", "") == "torch.nn.init"
                and isinstance(target, torch.Tensor) and target.is_meta):
            return target
        return func(*args, **kwargs)


def meta_gpt(cfg: GPTConfig, seed: int = 0, layout: StageLayout | None = None) -> GPT:
    """The GPT (cut to ``layout``'s stage when given) with every parameter on the meta device;
    the RoPE tables, small and derived from the config, are real (CPU)."""
    with _SkipInitOnMeta(), torch.device("meta"):
        return build_stage_model(cfg, seed, layout) if layout else build_model(cfg, seed=seed)
