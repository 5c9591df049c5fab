"""dtrain's Llama against transformers' LlamaForCausalLM (the real package), both ways.

The same weights must give the same logits: dtrain's model exported with `trainer.hf.folder`
and loaded by ``AutoModelForCausalLM.from_pretrained``, and a folder saved by transformers'
``save_pretrained`` read into dtrain's model. Both sides compute in fp32 in other orders (fused
k/v and gate/up matmuls, another RMSNorm kernel), so they differ by rounding only: each stage
on the way to a logit (the norms and matmuls of every block, the attention's sums over the
context, the head) adds at most `reduction_rtol` of its length relative to the magnitudes
summed, to first order, and the head turns that into an absolute bound per logit,
``forward_rtol * (|h| @ |W|ᵀ)`` with h the final hidden state.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers import LlamaConfig as HFLlamaConfig

from tests.support.numerics import U32, reduction_rtol
from trainer.hf.config import HFError
from trainer.hf.folder import load_serial, read_folder, write_folder
from trainer.hf.weights import INDEX
from trainer.model.config import PRESETS, GPTConfig
from trainer.model.llama import Llama
from trainer.model.llama_config import LlamaShape

CFG = replace(PRESETS["llama-tiny"], vocab_size=96, rope_theta=500000.0,
              llama=LlamaShape(n_kv_head=2, multiple_of=16, rope_scaling="llama3",
                               rope_original_seq_len=16))  # scaling active within 64


def forward_rtol(cfg: GPTConfig) -> float:
    """Rounding of the longest chain of sums to a logit, relative to the magnitudes summed."""
    stages = cfg.n_layer * (5 * cfg.d_model + 2 * cfg.seq_len + cfg.hidden) + 2 * cfg.d_model
    return reduction_rtol(stages, U32)


def logit_bound(model: Llama, idx: torch.Tensor) -> torch.Tensor:
    """Per-logit tolerance: the forward's rtol times the magnitudes the head sums (fp64)."""
    with torch.no_grad():
        h = model.ln_f(_hidden(model, idx)).double()
    return forward_rtol(model.cfg) * (h.abs() @ model.head.weight.double().abs().T) + 1e-30


def _hidden(model: Llama, idx: torch.Tensor) -> torch.Tensor:
    h = model.tok_emb(idx)
    for block in model.blocks.values():
        h = block(h, model.rope_cos, model.rope_sin)
    return h


def by_name(model: torch.nn.Module) -> Callable[[list[str]], dict[str, torch.Tensor]]:
    """What `write_folder` asks for: the model's whole parameters of some names."""
    params = dict(model.named_parameters())
    return lambda names: {name: params[name].detach() for name in names}


def assert_same_logits(ours: Llama, theirs: torch.nn.Module) -> None:
    """dtrain's and transformers' logits of one random batch differ by rounding only."""
    cfg = ours.cfg
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=gen)
    with torch.no_grad():
        a, b = ours(idx)[..., :cfg.vocab_size].double(), theirs(idx).logits.double()
    excess = (a - b).abs() - logit_bound(ours, idx)
    assert excess.max() <= 0, f"logits differ beyond rounding by {excess.max():.3g}"


def test_an_exported_llama_loads_in_transformers_with_the_same_logits(tmp_path: Path) -> None:
    ours = Llama(CFG, seed=3).eval()
    write_folder(tmp_path / "hf", CFG, by_name(ours), eos_token_id=0,
                 max_shard_bytes=40_000)
    assert (tmp_path / "hf" / INDEX).is_file(), "the small shard limit must give an index"
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(theirs) is LlamaForCausalLM
    assert_same_logits(ours, theirs)


def test_a_folder_saved_by_transformers_imports_with_the_same_logits(tmp_path: Path) -> None:
    hf_cfg = HFLlamaConfig(
        vocab_size=CFG.vocab_size, hidden_size=CFG.d_model, intermediate_size=CFG.hidden,
        num_hidden_layers=CFG.n_layer, num_attention_heads=CFG.n_head,
        num_key_value_heads=CFG.kv_heads, max_position_embeddings=CFG.seq_len,
        rms_norm_eps=CFG.norm_eps, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": CFG.rope_theta, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16})
    torch.manual_seed(0)
    theirs = LlamaForCausalLM(hf_cfg).eval()
    theirs.save_pretrained(tmp_path / "hf")
    folder = read_folder(tmp_path / "hf")
    # Hugging Face states the MLP's hidden size itself: kept as ffn_hidden, not the rule.
    assert folder.cfg == replace(CFG, llama=replace(CFG.llama, ffn_hidden=CFG.hidden,
                                                    multiple_of=256))
    ours = Llama(folder.cfg).eval()
    load_serial(ours, folder)
    assert_same_logits(ours, theirs)


def test_vocabulary_padding_is_dropped_on_export_and_zero_on_import(tmp_path: Path) -> None:
    padded = replace(CFG, vocab_multiple=64)  # 96 -> 128 rows
    ours = Llama(padded, seed=1)
    write_folder(tmp_path / "hf", padded, by_name(ours))
    back = read_folder(tmp_path / "hf", vocab_multiple=64)
    again = Llama(back.cfg)
    load_serial(again, back)
    assert torch.equal(again.head.weight[:96], ours.head.weight[:96])
    assert not again.head.weight[96:].any()


@pytest.mark.parametrize(("key", "value", "named"), [
    ("architectures", ["MistralForCausalLM"], "architectures"),
    ("model_type", "gemma", "model_type"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type"),
    ("hidden_act", "gelu", "hidden_act"),
    ("head_dim", 16, "head_dim"),
])
def test_an_unsupported_config_is_refused_naming_the_key(tmp_path: Path, key: str, value: object,
                                                         named: str) -> None:
    write_folder(tmp_path / "hf", CFG, by_name(Llama(CFG)))
    config = tmp_path / "hf" / "config.json"
    data = json.loads(config.read_text())
    config.write_text(json.dumps({**data, key: value}))
    with pytest.raises(HFError, match=f"{named} = ") as err:
        read_folder(tmp_path / "hf")
    assert str(config) in str(err.value)


def test_an_export_never_overwrites_a_folder(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep").write_text("mine")
    with pytest.raises(HFError, match="export folder exists"):
        write_folder(tmp_path / "hf", CFG, by_name(Llama(CFG)))
    assert (tmp_path / "hf" / "keep").read_text() == "mine"
