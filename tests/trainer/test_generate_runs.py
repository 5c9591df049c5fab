"""``python -m trainer.generate`` on the run of a byte-level model whose vocabulary is larger
than the 256 bytes (``--vocab-size 300``, no tokenizer): the ids above 255 are shown as
``<id:N>`` among the decoded bytes, never a crash (real training and sampling processes)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.support import PYTHON, REPO, dtrain_env
from tests.support.mpi_runs import forked_python
from trainer import checkpoint
from trainer.inference.merge import load_serial
from trainer.inference.sampling import sample_ids


def test_a_byte_level_run_with_300_ids_samples_its_ids_above_255_as_ids(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = subprocess.run([*forked_python(), "-m", "trainer.train", "--model", "tiny",
                           "--vocab-size", "300", "--seq-len", "16", "--global-batch", "4",
                           "--data-cap-mb", "0.25", "--eval-every", "0", "--steps", "1",
                           "--run-dir", str(run_dir)], capture_output=True, text=True,
                          cwd=REPO, env=dtrain_env(), timeout=240, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    done = subprocess.run([PYTHON, "-m", "trainer.generate", "--run-dir", str(run_dir),
                           "--prompt", "def ", "--tokens", "60", "--temperature", "3"],
                          capture_output=True, text=True, cwd=REPO, env=dtrain_env(),
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    model, _ = load_serial(checkpoint.latest(run_dir / "checkpoints"))
    ids = sample_ids(model, list(b"def "), tokens=60, temperature=3.0, seed=0)
    high = [i for i in ids if i > 255]
    assert high, "the sample holds no id above 255 (raise the temperature)"
    text = done.stdout.rstrip("\n")
    assert text.startswith("def ")
    assert [int(n) for n in re.findall(r"<id:(\d+)>", text)] == high
    parts = re.split(r"<id:\d+>", text[len("def "):])
    low = bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    assert "".join(parts) == low
