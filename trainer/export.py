"""python -m trainer.export --run-dir R --out DIR [--dtype bfloat16] [--max-shard-mb N]

Write the newest checkpoint of a Llama run, whatever layout it was trained in, as a Hugging Face
model folder that ``transformers``' ``AutoModelForCausalLM.from_pretrained(DIR)`` loads with no
custom code:

    config.json, generation_config.json     the model, EOS/BOS (`trainer.hf.config`)
    model.safetensors                        or model-0000k-of-0000N.safetensors + index above
                                             --max-shard-mb (Hugging Face's 5 GB by default)
    tokenizer.json                           the run's tokenizer (kept by a run on tokenized
                                             data, or from its --init-from-hf folder), for
                                             AutoTokenizer

A run started with ``--init-from-hf`` exports the source folder's special ids and its
``max_position_embeddings`` (`trainer.hf.source`), whatever ``--seq-len`` it trained at.

The checkpoint may be sharded any way (tp, pp, ZeRO-1/2/3 pieces over dp): its index and
files are read and verified once, then each parameter is put together from its slices, its
Hugging Face tensors written into the safetensors file being streamed, and the parameter
dropped before the next is read (`trainer.checkpoint.pieces.Assembler`,
`trainer.hf.weights.write_streamed`): an export holds one parameter at a time (plus one of its
tensors converted to ``--dtype``), never the whole model nor a whole Hugging Face shard. The
folder appears only when complete (`trainer.hf.folder`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from trainer import checkpoint
from trainer.checkpoint.pieces import Assembler
from trainer.checkpoint.run_dir import folder
from trainer.data.prepare import EOS_NAMES
from trainer.errors import ConfigError, TrainerError
from trainer.hf import source
from trainer.hf.folder import DTYPES, write_folder
from trainer.hf.weights import DEFAULT_SHARD_BYTES
from trainer.model.config import GPTConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.export",
                                     description="Write a run's newest checkpoint as a Hugging "
                                                 "Face model folder.")
    parser.add_argument("--run-dir", required=True, help="the training run's folder")
    parser.add_argument("--out", required=True, help="the new Hugging Face folder")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                        help="dtype of the written weights")
    parser.add_argument("--max-shard-mb", type=float, default=DEFAULT_SHARD_BYTES / 2**20,
                        help="largest weight file before the weights are split with an index")
    return parser


def special_ids(tokenizer: Path) -> tuple[int | None, int | None]:
    """(BOS, EOS) ids of a run's tokenizer: EOS by the names `trainer.data.prepare` knows,
    BOS by Llama's and GPT-2's."""
    tok = Tokenizer.from_file(str(tokenizer))
    eos = next((tok.token_to_id(n) for n in EOS_NAMES if tok.token_to_id(n) is not None), None)
    bos = next((tok.token_to_id(n) for n in ("<|begin_of_text|>", "<s>", "<bos>")
                if tok.token_to_id(n) is not None), None)
    return bos, eos


def export(run_dir: Path, out: Path, *, dtype: str, max_shard_bytes: int) -> Path:
    """Export the newest committed checkpoint of ``run_dir`` into ``out``."""
    root = folder(run_dir)
    path = checkpoint.latest(root)
    if path is None:
        raise checkpoint.CheckpointError(
            "no checkpoint to export", str(root), "there is no committed step-<N> folder",
            "Train with --run-dir pointing here first (a checkpoint is saved at the end)")
    _, meta = checkpoint.read_meta(path)  # verified against the commit record
    cfg = GPTConfig.from_dict(meta["model"])
    tokenizer = run_dir / "tokenizer.json"
    bos, eos = special_ids(tokenizer) if tokenizer.is_file() else (None, None)
    imported = source.read(run_dir)  # a run started from a Hugging Face folder: its facts
    if imported is not None:
        bos = imported.bos_token_id if imported.bos_token_id is not None else bos
        eos = imported.eos_token_id if imported.eos_token_id is not None else eos
    write_folder(out, cfg, Assembler(path), dtype=dtype,
                 tokenizer_dir=run_dir if tokenizer.is_file() else None, bos_token_id=bos,
                 eos_token_id=eos, max_shard_bytes=max_shard_bytes,
                 max_positions=imported.max_position_embeddings if imported else None)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trainer.export ...``: exit 0 with one line, or 2 with one message."""
    args = build_parser().parse_args(argv)
    try:
        if not args.max_shard_mb > 0:
            raise ConfigError("invalid option", f"--max-shard-mb {args.max_shard_mb}",
                              "must be a positive number", "Pass e.g. --max-shard-mb 5000")
        path = export(Path(args.run_dir), Path(args.out), dtype=args.dtype,
                      max_shard_bytes=int(args.max_shard_mb * 2**20))
    except TrainerError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"{args.out}: {path.name} of {args.run_dir} as a Hugging Face LlamaForCausalLM "
          f"({args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
