"""Which class builds a model of ``cfg.arch``, chosen once where a model is built
(`build_model`), never by branches inside a forward pass. The class also names its family's
parts (block, norm, dense MLP: a Llama's experts are SwiGLU MLPs, `trainer.model.gpt.GPT`).
"""

from __future__ import annotations

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

