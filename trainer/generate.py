"""python -m trainer.generate --run-dir DIR --prompt TEXT [--tokens N --temperature T \
        --top-k K --seed S]

Sample text from the newest checkpoint of a run, whatever layout it was trained in:

    python -m trainer.generate --run-dir runs/3d --prompt "def main(" --temperature 0  # greedy

The checkpoint's slices are put together into the single-device GPT on this one process from
its index alone (`trainer.inference.merge`: no parallel model is built), so a model trained at
any layout (every axis of the mesh) or ZeRO stage samples the same.
The prompt's UTF-8 bytes are continued by ``--tokens`` bytes (`trainer.inference.sampling`),
printed after the prompt. With ``--from-run --tp N`` on the ranks of an MPI job the run is
rebuilt as ZeRO-3 shards instead and sampled switched to N-way tensor parallelism, no rank
holding the whole model (`trainer.inference.from_run`). Bytes that are not valid UTF-8 are
shown as U+FFFD, and ids above 255 (a byte-level run with a larger ``--vocab-size`` has them,
with no tokenizer to name them) as ``<id:N>``. A run trained on tokenized data, or started
from a Hugging Face folder (``--init-from-hf``), kept its tokenizer
(``<run-dir>/tokenizer.json``): the prompt is encoded
and the ``--tokens`` new tokens decoded with it.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from trainer import checkpoint
from trainer.checkpoint.run_dir import folder
from trainer.errors import ConfigError, TrainerError
from trainer.inference.merge import load_serial
from trainer.inference.sampling import sample_ids
from trainer.model.config import GPTConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.generate",
                                     description="Sample bytes from a run's newest checkpoint.")
    parser.add_argument("--run-dir", required=True, help="the training run's folder")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--tokens", type=int, default=200, help="bytes to generate")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="softmax temperature; 0 = greedy (always the likeliest byte)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample among the k likeliest bytes only (0 = all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling stream")
    parser.add_argument("--from-run", action="store_true",
                        help="on the ranks of an MPI job: rebuild the run as ZeRO-3 shards "
                             "and sample from it switched to --tp tensor parallelism, no rank "
                             "holding the whole model (trainer.inference.from_run)")
    parser.add_argument("--tp", type=int, default=1,
                        help="with --from-run: tensor-parallel size of the generation groups "
                             "(divides the number of ranks)")
    return parser


def generate(args: argparse.Namespace) -> str | None:
    """The prompt and its continuation, as text (None on the ranks of a ``--from-run`` job
    but rank 0)."""
    for name, low in (("tokens", 1), ("top_k", 0), ("tp", 1)):
        if getattr(args, name) < low:
            raise ConfigError("invalid option", f"--{name.replace('_', '-')} "
                              f"{getattr(args, name)}", f"must be >= {low}",
                              f"Pass a value >= {low}")
    if not 0 <= args.temperature < math.inf:
        raise ConfigError("invalid option", f"--temperature {args.temperature}",
                          "must be a finite number >= 0",
                          "Pass 0 for greedy decoding or a positive value")
    if not 0 <= args.seed < 2**64:
        raise ConfigError("invalid option", f"--seed {args.seed}",
                          "must be >= 0 and below 2**64 (a 64-bit seed)",
                          "Pass a smaller --seed")
    root = folder(Path(args.run_dir))
    path = checkpoint.latest(root)
    if path is None:
        raise checkpoint.CheckpointError(
            "no checkpoint to sample from", str(root), "there is no committed step-<N> folder",
            "Train with --run-dir pointing here first (a checkpoint is saved at the end)")
    check_model_fields(path)
    tokenizer = Path(args.run_dir) / "tokenizer.json"  # kept by a run on tokenized data
    tok = Tokenizer.from_file(str(tokenizer)) if tokenizer.is_file() else None
    prompt = tok.encode(args.prompt, add_special_tokens=False).ids if tok else \
        list(args.prompt.encode())
    if args.from_run:
        from trainer.inference.from_run import sample_from_run  # builds a run: MPI, torch

        got = sample_from_run(args, prompt)
        if got is None:  # not rank 0: the sample is printed once
            return None
        out = got
    else:
        model, _ = load_serial(path)
        out = sample_ids(model, prompt, tokens=args.tokens, temperature=args.temperature,
                         top_k=args.top_k, seed=args.seed, unit="token" if tok else "byte")
    return tok.decode(prompt + out) if tok else byte_text(prompt + out)


def byte_text(ids: list[int]) -> str:
    """The text of a byte-level run's ids: bytes as UTF-8 (U+FFFD where invalid); an id above
    255 (a vocabulary larger than the bytes, without a tokenizer to name it) as ``<id:N>``."""
    text, run = [], bytearray()
    for i in ids:
        if i < 256:
            run.append(i)
            continue
        text += [run.decode("utf-8", errors="replace"), f"<id:{i}>"]
        run = bytearray()
    return "".join([*text, run.decode("utf-8", errors="replace")])


def check_model_fields(path: Path) -> None:
    """Refuse a checkpoint whose model has fields this dtrain does not know (a newer dtrain
    wrote it): it would be built without them, a different model."""
    _, meta = checkpoint.read_meta(path)  # verified against the commit record
    known = set(GPTConfig().to_dict())
    unknown = sorted(set(meta.get("model", {})) - known)
    if unknown:
        raise checkpoint.CheckpointError(
            "checkpoint of a newer dtrain", str(path / "meta.json"),
            f"its model has field(s) this dtrain does not know: {', '.join(unknown)}",
            "Sample with the dtrain that trained it (or a newer one)")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trainer.generate ...``: print the sample; exit 2 with one message on bad
    input."""
    args = build_parser().parse_args(argv)
    try:
        text = generate(args)
        if text is not None:
            print(text, flush=True)
    except TrainerError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
