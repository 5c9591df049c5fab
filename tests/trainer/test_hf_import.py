"""Starting a run from a Hugging Face folder (``--init-from-hf``) as a user does: a real folder
saved by transformers, a real training process. A broken weight file is one error naming it;
the folder's tokenizer comes with the run, into its samples and its export."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaForCausalLM
from transformers import LlamaConfig as HFLlamaConfig

from tests.support import PYTHON, REPO, dtrain_env
from tests.support.mpi_runs import forked_python
from trainer import checkpoint
from trainer.inference.merge import load_serial
from trainer.inference.sampling import sample_ids

FLAGS = ["--seq-len", "16", "--global-batch", "4", "--eval-every", "0", "--data-cap-mb", "0.25",
         "--log-every", "1", "--warmup-steps", "1"]


def hf_folder(out: Path, *, vocab: int = 256, max_shard_size: str = "5GB") -> Path:
    cfg = HFLlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64, rms_norm_eps=1e-5,
                        tie_word_embeddings=False)
    torch.manual_seed(1)
    LlamaForCausalLM(cfg).save_pretrained(out, max_shard_size=max_shard_size)
    return out


def train(run_dir: Path, *extra: str) -> tuple[int, str]:
    done = subprocess.run([*forked_python(), "-m", "trainer.train", *FLAGS, "--run-dir",
                           str(run_dir), *extra], capture_output=True, text=True, cwd=REPO,
                          env=dtrain_env(), timeout=240, check=False)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_a_cut_off_weight_file_is_one_error_naming_it(tmp_path: Path, sharded: bool) -> None:
    folder = hf_folder(tmp_path / "hf", max_shard_size="60KB" if sharded else "5GB")
    files = sorted(folder.glob("model*.safetensors"))
    assert len(files) > 1 if sharded else [f.name for f in files] == ["model.safetensors"]
    broken = files[-1]
    broken.write_bytes(broken.read_bytes()[:1000])  # a download cut short
    code, out = train(tmp_path / "run", "--init-from-hf", str(folder), "--steps", "1")
    assert code == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if "error" in line.lower()]
    assert len(lines) == 1, out[-3000:]
    assert lines[0].startswith(f"error: unreadable Hugging Face weights [{broken}]: "), lines[0]
    assert lines[0].endswith("(a download cut short, or not a safetensors file). Download or "
                             "save the folder again (save_pretrained)"), lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


def bpe_tokenizer(vocab: int) -> Tokenizer:
    """A byte-level BPE of ``vocab`` ids trained on the json package's sources, its first two
    ids the special BOS and EOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in sorted(Path(json.__file__).parent.glob("*.py"))], trainer)
    assert tok.get_vocab_size() == vocab
    return tok


def test_a_run_from_a_folder_keeps_its_tokenizer_special_ids_and_positions(
        tmp_path: Path) -> None:
    vocab = 300
    folder = hf_folder(tmp_path / "hf", vocab=vocab)
    config = json.loads((folder / "config.json").read_text())
    config.update(bos_token_id=0, eos_token_id=1)
    (folder / "config.json").write_text(json.dumps(config))
    tok = bpe_tokenizer(vocab)
    tok.save(str(folder / "tokenizer.json"))
    run_dir = tmp_path / "run"
    code, out = train(run_dir, "--init-from-hf", str(folder), "--steps", "1")
    assert code == 0, out[-3000:]
    assert (run_dir / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()

    done = subprocess.run([PYTHON, "-m", "trainer.generate", "--run-dir", str(run_dir),
                           "--prompt", "import json", "--tokens", "12", "--temperature", "1"],
                          capture_output=True, text=True, cwd=REPO, env=dtrain_env(),
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    model, _ = load_serial(checkpoint.latest(run_dir / "checkpoints"))
    ids = tok.encode("import json", add_special_tokens=False).ids
    assert done.stdout.rstrip("\n") == tok.decode(
        ids + sample_ids(model, ids, tokens=12, temperature=1.0, seed=0))

    done = subprocess.run([PYTHON, "-m", "trainer.export", "--run-dir", str(run_dir), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO,
                          env=dtrain_env(), timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (0, 1)
    assert exported["max_position_embeddings"] == 64  # the source's, trained at --seq-len 16
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == \
        (folder / "tokenizer.json").read_bytes()
    assert AutoTokenizer.from_pretrained(tmp_path / "out").decode(ids) == "import json"
