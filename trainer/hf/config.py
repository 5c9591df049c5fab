"""A Llama's config as Hugging Face writes it (``config.json``, ``generation_config.json``), both
ways, refusing what dtrain's Llama does not compute.

Reading takes Hugging Face's two spellings of the rotary settings: ``rope_theta`` plus
``rope_scaling`` (transformers 4) and ``rope_parameters`` (transformers 5, which still reads the
first). Writing uses the first, which both versions read. A config dtrain cannot reproduce
exactly, another architecture, another activation, biases, a head size other than
``hidden_size / num_attention_heads``, a rope type other than the default or ``llama3``, is
refused naming the key, never approximated.
"""

from __future__ import annotations

from typing import Any

from trainer.errors import ConfigError, TrainerError
from trainer.model.config import GPTConfig
from trainer.model.llama_config import LlamaShape

ARCHITECTURE = "LlamaForCausalLM"


class HFError(TrainerError):
    """A Hugging Face folder cannot be read or written as asked."""


def _refuse(where: str, key: str, value: object, why: str) -> HFError:
    return HFError("unsupported Hugging Face config", f"{where}: {key} = {value!r}", why,
                   "Import a Llama (LlamaForCausalLM) checkpoint with default or llama3 rope "
                   "scaling, or convert the model with its own tools")


def _rope(hf: dict[str, Any], where: str) -> tuple[float, dict[str, Any]]:
    """rope_theta and the `LlamaShape` fields of the rotary settings in ``hf``."""
    params = hf.get("rope_parameters") or {}
    key = "rope_parameters" if params else "rope_scaling"
    scaling = params or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, {}
    if kind != "llama3":
        raise _refuse(where, f"{key}.rope_type", kind,
                      "dtrain's Llama implements the default rotary frequencies and Llama 3's "
                      "scaling ('llama3') only")
    missing = [hf_key for hf_key in _LLAMA3.values() if hf_key not in scaling]
    if missing:
        raise _refuse(where, f"{key}.{missing[0]}", None, "llama3 rope scaling needs it")
    fields: dict[str, Any] = {"rope_scaling": "llama3"}
    for ours, hf_key in _LLAMA3.items():
        fields[ours] = type(getattr(LlamaShape(), ours))(scaling[hf_key])
    return theta, fields


_LLAMA3 = {"rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
           "rope_high_freq_factor": "high_freq_factor",
           "rope_original_seq_len": "original_max_position_embeddings"}


def from_hf_config(hf: dict[str, Any], where: str, *, seq_len: int | None = None,
                   vocab_multiple: int = 1) -> GPTConfig:
    """The Llama `GPTConfig` of a Hugging Face ``config.json`` (``where`` names it in errors).
    ``seq_len`` is the training context (default: ``max_position_embeddings``)."""
    archs = hf.get("architectures") or [ARCHITECTURE]
    if hf.get("model_type", "llama") != "llama" or ARCHITECTURE not in archs:
        key, value = (("model_type", hf.get("model_type")) if hf.get("model_type") != "llama"
                      else ("architectures", archs))
        raise _refuse(where, key, value, f"dtrain imports {ARCHITECTURE} only")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, want) != want:
            raise _refuse(where, key, hf[key], f"dtrain's Llama has {key} = {want!r}")
    try:
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        if hf.get("head_dim") not in (None, d // heads):
            raise _refuse(where, "head_dim", hf["head_dim"],
                          f"dtrain's Llama has head_dim = hidden_size / num_attention_heads "
                          f"= {d // heads}")
        theta, rope = _rope(hf, where)
        shape = LlamaShape(n_kv_head=int(hf.get("num_key_value_heads") or heads),
                           ffn_hidden=int(hf["intermediate_size"]), **rope)
        return GPTConfig(
            arch="llama", norm="rmsnorm", vocab_size=int(hf["vocab_size"]),
            vocab_multiple=vocab_multiple, n_layer=int(hf["num_hidden_layers"]), n_head=heads,
            d_model=d, seq_len=seq_len or int(hf.get("max_position_embeddings", 2048)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            tied=bool(hf.get("tie_word_embeddings", False)), llama=shape)
    except KeyError as err:
        raise HFError("incomplete Hugging Face config", where, f"the key {err} is missing",
                      "Use the config.json written with the weights") from None
    except (TypeError, ValueError) as err:
        raise HFError("invalid Hugging Face config", where, str(err),
                      "Use the config.json written with the weights") from None
    except ConfigError as err:
        raise HFError("invalid Hugging Face config", where, f"{err.where}: {err.why}",
                      "Use the config.json written with the weights") from None


def to_hf_config(cfg: GPTConfig, *, dtype: str, bos_token_id: int | None = None,
                 eos_token_id: int | None = None,
                 max_positions: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` that transformers' `AutoModelForCausalLM` loads as is;
    ``max_positions``: the positions the model is made for, when more than it trained at (an
    imported model's, `trainer.hf.source`)."""
    scaling = None
    if cfg.llama.rope_scaling == "llama3":
        scaling = {"rope_type": "llama3",
                   **{hf_key: getattr(cfg.llama, ours) for ours, hf_key in _LLAMA3.items()}}
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.hidden, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": max(cfg.seq_len, max_positions or 0),
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
        "tie_word_embeddings": cfg.tied, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "torch_dtype": dtype,
    }


def generation_config(*, bos_token_id: int | None, eos_token_id: int | None) -> dict[str, Any]:
    """``generation_config.json``: the special tokens generation stops and starts at."""
    return {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "do_sample": True}
