"""Starting a run from a Hugging Face folder (``--init-from-hf``) as a user does: a real folder
saved by transformers, a real training process. A broken weight file is one error naming it;
the folder's tokenizer comes with the run, into its samples and its export."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from tests.mpi_runs import forked_python
from tests.support import REPO, dtrain_env

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
