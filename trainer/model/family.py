"""Which classes build a model of ``cfg.arch``: the model itself and its dense MLP.

Chosen once where a model is built (`build_model`), never by branches inside a forward pass.
The MLP is asked for separately because mixture-of-experts layers
(`trainer.parallel.expert.layer`) make
their experts from it: a Llama's experts are SwiGLU MLPs.
"""

from __future__ import annotations

from torch import nn

from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.model.layers import MLP
from trainer.model.llama import Llama, SwiGLU

MODELS: dict[str, type[GPT]] = {"gpt": GPT, "llama": Llama}
DENSE_MLPS = (MLP, SwiGLU)
"""The dense MLP classes (tensor parallelism splits their ``fc`` with ``fc_stride``)."""


def build_model(cfg: GPTConfig, *, seed: int = 0) -> GPT:
    """The plain single-device model of ``cfg``'s family, initialised from ``seed`` (on the
    meta device inside a ``torch.device("meta")`` block: shapes only)."""
    return MODELS[cfg.arch](cfg, seed=seed)


def make_mlp(cfg: GPTConfig) -> nn.Module:
    """The dense MLP of ``cfg``'s family (an expert of an MoE layer is one)."""
    return SwiGLU(cfg) if cfg.arch == "llama" else MLP(cfg)
