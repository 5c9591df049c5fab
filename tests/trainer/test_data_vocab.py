"""The model's vocabulary on tokenized data, as a user runs it (``python -m trainer.data.prepare``
with a trained BPE, then ``python -m trainer.train --data DIR``, real processes): without
``--vocab-size`` the model takes the dataset's tokenizer's vocabulary, whatever the preset's;
a ``--vocab-size`` given that the ids do not fit is refused, as before."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support import PYTHON, REPO, dtrain_env
from trainer import checkpoint
from trainer.data.prepare import main as prepare_main
from trainer.data.token_files import MANIFEST

VOCAB = 300
FLAGS = ["--model", "llama-tiny", "--seq-len", "16", "--global-batch", "4", "--warmup-steps",
         "1", "--eval-every", "0", "--log-every", "1"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The json package's sources, tokenized with a BPE of 300 ids (more than llama-tiny's 256)."""
    root = tmp_path_factory.mktemp("vocab")
    sources = sorted(Path(json.__file__).parent.glob("*.py"))
    assert prepare_main(["--input", *map(str, sources), "--out", str(root / "ds"),
                         "--train-bpe", str(VOCAB), "--quiet"]) == 0
    assert json.loads((root / "ds" / MANIFEST).read_text())["vocab_size"] == VOCAB
    return root / "ds"


def train(run_dir: Path, *extra: str) -> tuple[int, str]:
    done = subprocess.run([PYTHON, "-m", "trainer.train", *FLAGS, "--run-dir", str(run_dir),
                           *extra], capture_output=True, text=True, cwd=REPO,
                          env=dtrain_env(), timeout=300, check=False)
    return done.returncode, done.stdout + done.stderr


def test_without_vocab_size_the_model_takes_the_datasets_vocabulary(dataset: Path,
                                                                    tmp_path: Path) -> None:
    code, out = train(tmp_path / "run", "--data", str(dataset), "--steps", "1")
    assert code == 0, out[-3000:]
    _, meta = checkpoint.read_meta(checkpoint.latest(tmp_path / "run" / "checkpoints"))
    assert meta["model"]["vocab_size"] == VOCAB


def test_a_given_vocab_size_smaller_than_the_datasets_is_still_refused(
        dataset: Path, tmp_path: Path) -> None:
    code, out = train(tmp_path / "run", "--data", str(dataset), "--vocab-size", "256",
                      "--steps", "1")
    assert code == 2, out[-3000:]
    assert out.count(f"error: tokenizer does not fit the model [{dataset / MANIFEST}]: its "
                     f"vocabulary has {VOCAB} ids, the model only 256") == 1, out[-3000:]
