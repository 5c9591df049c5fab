"""Which Hugging Face tensors make each parameter of dtrain's Llama, and back.

Most parameters are one Hugging Face tensor under another name. Two are fused in dtrain
(`trainer.model.llama`): ``attn.kv`` stacks ``k_proj`` over ``v_proj`` and ``mlp.fc`` stacks
``gate_proj`` over ``up_proj`` (rows, dim 0). The rotary layout is Hugging Face's
(``rotate_half``), so q and k need no permutation. The embedding and head of dtrain may have
padded vocabulary rows (`trainer.gpu.vocab`): exported without them, zeros on import.

`pieces` answers for one parameter: the Hugging Face tensors, in the order their rows are
stacked, with their shapes. A tensor-parallel shard with stride s of a parameter made of s
equal pieces is then block r of every piece (`trainer.parallel.tensor.sharding`), so a rank can
read exactly its rows from the files (`trainer.hf.weights`).
"""

from __future__ import annotations

import re

import torch

from trainer.hf.config import HFError
from trainer.model.config import GPTConfig

_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_SIMPLE = {"ln1.weight": "input_layernorm.weight",
           "ln2.weight": "post_attention_layernorm.weight",
           "attn.q.weight": "self_attn.q_proj.weight",
           "attn.proj.weight": "self_attn.o_proj.weight",
           "mlp.proj.weight": "mlp.down_proj.weight"}
EMBEDDING, HEAD, NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"

Piece = tuple[str, tuple[int, ...]]
"""(Hugging Face tensor name, its shape)."""


def pieces(name: str, cfg: GPTConfig) -> list[Piece]:
    """The Hugging Face tensors whose rows, stacked in this order, make dtrain's parameter
    ``name`` (without its padded vocabulary rows)."""
    d, f, kv = cfg.d_model, cfg.hidden, cfg.kv_heads * cfg.head_dim
    if name == "tok_emb.weight" or (name == "head.weight" and cfg.tied):
        return [(EMBEDDING, (cfg.vocab_size, d))]
    if name == "head.weight":
        return [(HEAD, (cfg.vocab_size, d))]
    if name == "ln_f.weight":
        return [(NORM, (d,))]
    match = _BLOCK.fullmatch(name)
    if match is None:
        raise _no_counterpart(name)
    prefix, rest = f"model.layers.{match[1]}.", match[2]
    if rest == "attn.kv.weight":
        return [(prefix + "self_attn.k_proj.weight", (kv, d)),
                (prefix + "self_attn.v_proj.weight", (kv, d))]
    if rest == "mlp.fc.weight":
        return [(prefix + "mlp.gate_proj.weight", (f, d)), (prefix + "mlp.up_proj.weight", (f, d))]
    shapes = {"ln1.weight": (d,), "ln2.weight": (d,), "attn.q.weight": (d, d),
              "attn.proj.weight": (d, d), "mlp.proj.weight": (d, f)}
    if rest not in shapes:
        raise _no_counterpart(name)
    return [(prefix + _SIMPLE[rest], shapes[rest])]


def serial_names(cfg: GPTConfig) -> list[str]:
    """dtrain's parameter names of the whole serial Llama, in module order (a tied head is
    the embedding and not listed)."""
    per_block = ["ln1.weight", "attn.q.weight", "attn.kv.weight", "attn.proj.weight",
                 "ln2.weight", "mlp.fc.weight", "mlp.proj.weight"]
    names = ["tok_emb.weight"]
    names += [f"blocks.{i}.{p}" for i in range(cfg.n_layer) for p in per_block]
    return names + ["ln_f.weight"] + ([] if cfg.tied else ["head.weight"])


def split_to_hf(name: str, full: torch.Tensor, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """dtrain's whole parameter ``name`` as its Hugging Face tensors (padded rows dropped)."""
    out: dict[str, torch.Tensor] = {}
    start = 0
    for hf, shape in pieces(name, cfg):
        out[hf] = full[start:start + shape[0]]
        start += shape[0]
    return out


def _no_counterpart(name: str) -> HFError:
    return HFError("parameter without a Hugging Face counterpart", name,
                   "Hugging Face's LlamaForCausalLM has no such tensor (a mixture-of-experts "
                   "layer, or a GPT parameter)", "Export a dense Llama run (--arch llama)")
