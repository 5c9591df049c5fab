"""Hugging Face import and export through the trainer, as a user runs them (real processes).

- A Llama trained at tp2 x pp2 (four ranks under ``mpiexec``) is exported with ``python -m
  trainer.export``; transformers' ``AutoModelForCausalLM.from_pretrained`` loads the folder
  and gives the logits of the checkpoint's model.
- A Llama trained at dp 4 under ZeRO-3 (its checkpoint holds flat pieces of every parameter)
  is exported holding at most one parameter at a time (measured by counting the tensor
  storages the export makes, `tests.support.tensor_bytes`), and the export equals, bit for
  bit, that of the same weights saved by one process at zero 0.
- A folder saved by transformers' ``save_pretrained`` starts a tp2 run with ``--init-from-hf``
  (every rank reading its own slices); one step at learning rate 0 leaves the weights as they
  were, and the run's checkpoint gives transformers' logits.

Logits are compared within the fp32 rounding bound of `tests.trainer.test_llama_hf`.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers import LlamaConfig as HFLlamaConfig

from tests.support import PYTHON, REPO, dtrain_env
from tests.support.mpi_runs import run_ranks
from tests.support.tensor_bytes import TensorBytes
from tests.trainer.test_llama_hf import assert_same_logits
from trainer import checkpoint
from trainer.checkpoint.pieces import Assembler
from trainer.export import export
from trainer.inference.merge import load_serial
from trainer.training.metrics import read_records

FLAGS = ["--model", "llama-tiny", "--seq-len", "32", "--global-batch", "4", "--microbatches",
         "2", "--eval-every", "0", "--data-cap-mb", "0.25", "--log-every", "1"]


def train(ranks: int, run_dir: Path, *extra: str) -> None:
    done = run_ranks(ranks, ["-m", "trainer.train", *FLAGS, "--run-dir", str(run_dir), *extra])
    assert done.returncode == 0, done.stdout[-3000:]


def test_a_tp2_pp2_checkpoint_exported_loads_in_transformers_with_its_logits(
        tmp_path: Path) -> None:
    train(4, tmp_path / "run", "--tp", "2", "--pp", "2", "--steps", "2")
    done = subprocess.run([PYTHON, "-m", "trainer.export", "--run-dir", str(tmp_path / "run"),
                           "--out", str(tmp_path / "hf"), "--max-shard-mb", "0.1"],
                          capture_output=True, text=True, cwd=REPO, env=dtrain_env(),
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ours, meta = load_serial(checkpoint.latest(tmp_path / "run" / "checkpoints"))
    assert meta["layout"]["tp"] == 2 and meta["layout"]["pp"] == 2
    assert_same_logits(ours, theirs)


def exported(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an exported folder, read back by safetensors."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    return out


def test_a_zero3_dp4_run_exports_one_parameter_at_a_time_as_the_zero0_weights_do(
        tmp_path: Path) -> None:
    """The export streams: it holds the parameter it is writing and the one saved piece it is
    reading at most, under twice the largest parameter, while the model is 9 times that (the
    default 5 GB shard limit puts every tensor into one file, which the export used to put
    together whole). One more step at learning rate 0 at zero 0 on one process (AdamW then
    moves nothing) saves the same weights as whole tensors: both exports are bit-equal."""
    run = tmp_path / "run"
    shape = ("--n-layer", "4", "--microbatches", "1")
    train(4, run, *shape, "--dp", "4", "--zero", "3", "--steps", "2")
    step2 = checkpoint.latest(run / "checkpoints")
    layout = checkpoint.read_meta(step2)[1]["layout"]
    assert (layout["dp"], layout["zero"]) == (4, 3)
    with TensorBytes() as meter:
        export(run, tmp_path / "hf3", dtype="float32", max_shard_bytes=5 * 1000**3)
    shapes = Assembler(step2).shapes
    sizes = [math.prod(shape) * 4 for shape in shapes.values()]
    assert meter.peak <= 2 * max(sizes) and 2 * max(sizes) < sum(sizes) / 4
    assert meter.live == 0
    train(1, run, *shape, "--zero", "0", "--steps", "3", "--resume", "--lr", "0", "--min-lr",
          "0", "--warmup-steps", "0")
    assert checkpoint.latest(run / "checkpoints").name == "step-3"
    export(run, tmp_path / "hf0", dtype="float32", max_shard_bytes=5 * 1000**3)
    three, zero = exported(tmp_path / "hf3"), exported(tmp_path / "hf0")
    assert three.keys() == zero.keys() and len(three) == 2 + 1 + 4 * 9
    for key, want in zero.items():
        assert torch.equal(three[key], want), key
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf3", dtype=torch.float32).eval()
    assert_same_logits(load_serial(step2)[0], theirs)


def test_a_transformers_folder_imported_at_tp2_gives_transformers_logits(tmp_path: Path) -> None:
    hf_cfg = HFLlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176,
                           num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                           max_position_embeddings=32, rms_norm_eps=1e-5,
                           tie_word_embeddings=False, rope_theta=500000.0)
    torch.manual_seed(1)
    theirs = LlamaForCausalLM(hf_cfg).eval()
    theirs.save_pretrained(tmp_path / "hf")
    train(2, tmp_path / "run", "--tp", "2", "--init-from-hf", str(tmp_path / "hf"),
          "--steps", "1", "--lr", "0", "--min-lr", "0", "--warmup-steps", "0")
    ours, meta = load_serial(checkpoint.latest(tmp_path / "run" / "checkpoints"))
    assert meta["layout"]["tp"] == 2 and meta["model"]["n_kv_head"] == 2
    assert_same_logits(ours, theirs)


def test_export_refuses_a_gpt_run_with_one_message(tmp_path: Path) -> None:
    train(1, tmp_path / "gpt", "--model", "tiny", "--steps", "1")
    done = subprocess.run([PYTHON, "-m", "trainer.export", "--run-dir", str(tmp_path / "gpt"),
                           "--out", str(tmp_path / "hf")], capture_output=True, text=True,
                          cwd=REPO, env=dtrain_env(), timeout=300, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("no Hugging Face architecture for this model [arch = gpt]") == 1
    assert not (tmp_path / "hf").exists() and len(list(tmp_path.iterdir())) == 1


def test_a_llama_trains_in_bf16_with_fp32_main_weights(tmp_path: Path) -> None:
    train(1, tmp_path / "bf16", "--precision", "bf16", "--steps", "8", "--lr", "1e-2",
          "--warmup-steps", "1")
    records = read_records(tmp_path / "bf16" / "metrics.jsonl")
    losses = [r["loss"] for r in records]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.3  # it learns (byte data: ~5.5 nats at the start)
    ours, _ = load_serial(checkpoint.latest(tmp_path / "bf16" / "checkpoints"))
    assert ours.cfg.arch == "llama"
