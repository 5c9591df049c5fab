"""A Hugging Face model folder: written from dtrain's Llama weights, and read to start from.

    config.json               the model (`trainer.hf.config`)
    generation_config.json    bos/eos for generation
    model*.safetensors        the weights, sharded above a size limit (`trainer.hf.weights`)
    tokenizer.json (+ tokenizer_config.json, special_tokens_map.json when present)

`write_folder` writes into a fresh temporary folder beside ``out`` and renames it into place,
so an export that fails midway leaves nothing half-written and never touches an existing
folder. `read_folder` refuses a folder that is not a Llama before reading any weight;
`load_serial` fills a whole model, `load_rank_slices` one rank's stage and tensor-parallel
shards (``--init-from-hf``), each reading only the rows or columns it keeps.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.hf.config import HFError, from_hf_config, generation_config, to_hf_config
from trainer.hf.names import pieces, serial_names, split_to_hf
from trainer.hf.weights import DEFAULT_SHARD_BYTES, HFWeights, write_weights
from trainer.model.config import GPTConfig
from trainer.parallel.tensor.sharding import shard_spec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Folder:
    """A Hugging Face Llama folder, read: its model config, weights and tokenizer (if any)."""

    cfg: GPTConfig
    weights: HFWeights
    tokenizer: Path | None
    """Its ``tokenizer.json``, when it has one."""


def read_folder(folder: Path, *, seq_len: int | None = None, vocab_multiple: int = 1) -> Folder:
    """Open ``folder`` (config checked first; weights are read later, by slice)."""
    config = folder / "config.json"
    try:
        hf = json.loads(config.read_text())
    except OSError as err:
        raise HFError("cannot read Hugging Face config", str(config), err.strerror or str(err),
                      "Pass a folder written by save_pretrained or trainer.export") from None
    except ValueError as err:
        raise HFError("invalid Hugging Face config", str(config), f"not JSON: {err}",
                      "Use the config.json saved with the weights") from None
    if not isinstance(hf, dict):
        raise HFError("invalid Hugging Face config", str(config), "not a JSON object",
                      "Use the config.json saved with the weights")
    cfg = from_hf_config(hf, str(config), seq_len=seq_len, vocab_multiple=vocab_multiple)
    tokenizer = folder / "tokenizer.json"
    return Folder(cfg, HFWeights(folder), tokenizer if tokenizer.is_file() else None)


def write_folder(out: Path, cfg: GPTConfig,
                 params: Callable[[list[str]], dict[str, torch.Tensor]], *,
                 dtype: str = "float32", tokenizer_dir: Path | None = None,
                 bos_token_id: int | None = None, eos_token_id: int | None = None,
                 max_positions: int | None = None,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write ``cfg``'s model into the new folder ``out``; ``params(names)`` gives dtrain's
    whole parameters of those names (`trainer.hf.names.serial_names`), asked for one at a
    time, each dropped before the next is asked for (and asked again only when its Hugging
    Face tensors fall into two files), so an export holds one parameter, and one of its
    Hugging Face tensors in the written dtype, at a time."""
    if cfg.arch != "llama":
        raise HFError("no Hugging Face architecture for this model", f"arch = {cfg.arch}",
                      "dtrain exports Llama models (LlamaForCausalLM) only; its GPT has no "
                      "Hugging Face class", "Train with --arch llama to export")
    if out.exists():
        raise HFError("export folder exists", str(out), "it would be overwritten",
                      "Pass a new --out, or remove the old folder first")
    torch_dtype = DTYPES[dtype]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        entries = [(hf, shape) for name in serial_names(cfg) for hf, shape in pieces(name, cfg)]
        owner = {hf: name for name in serial_names(cfg) for hf, _ in pieces(name, cfg)}
        hand: dict[str, torch.Tensor] = {}
        """The one dtrain parameter in hand (its Hugging Face tensors are written in turn)."""

        def fetch(hf: str) -> torch.Tensor:
            name = owner[hf]
            if name not in hand:
                hand.clear()  # the previous parameter goes before the next is read
                hand.update(params([name]))
            return split_to_hf(name, hand[name], cfg)[hf].to(torch_dtype)

        write_weights(tmp, entries, torch_dtype, fetch, max_shard_bytes)
        hand.clear()
        _write_json(tmp / "config.json", to_hf_config(
            cfg, dtype=dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
            max_positions=max_positions))
        _write_json(tmp / "generation_config.json",
                    generation_config(bos_token_id=bos_token_id, eos_token_id=eos_token_id))
        if tokenizer_dir is not None:
            for file in TOKENIZER_FILES:
                if (tokenizer_dir / file).is_file():
                    shutil.copyfile(tokenizer_dir / file, tmp / file)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the export from other users
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


@torch.no_grad()
def load_serial(model: torch.nn.Module, folder: Folder) -> None:
    """Copy the folder's weights into a whole (serial) Llama of the folder's config, in place."""
    for name, p in model.named_parameters():
        p.copy_(folder.weights.rows(name, folder.cfg, 0, [(0, p.shape[0])]))


@torch.no_grad()
def load_rank_slices(model: torch.nn.Module, folder: Folder, tp_rank: int, tp_size: int) -> None:
    """Fill every parameter of this rank's model (its pipeline stage, its tensor-parallel
    shards) with its slice of the folder's weights, reading only that slice from the files."""
    params = dict(model.named_parameters())
    for name, value in rank_slices(model, folder, tp_rank, tp_size):
        params[name].copy_(value.to(params[name].dtype))


def rank_slices(model: torch.nn.Module, folder: Folder, tp_rank: int, tp_size: int
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's slice of the folder's weight) for every parameter of ``model``, one
    at a time, each read on its own (ZeRO-3 keeps only its shards of each,
    `trainer.construction.shards`)."""
    for name, p in model.named_parameters():
        spec = shard_spec(p)
        if spec is None or tp_size == 1:
            value = folder.weights.rows(name, folder.cfg, 0, [(0, p.shape[0])])
        else:
            full = p.shape[spec.dim] * tp_size
            part = full // spec.stride
            block = part // tp_size
            ranges = [(k * part + tp_rank * block, k * part + (tp_rank + 1) * block)
                      for k in range(spec.stride)]
            value = folder.weights.rows(name, folder.cfg, spec.dim, ranges)
        yield name, value
