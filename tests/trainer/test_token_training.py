"""Training on tokenized data as a user runs it: ``python -m trainer.data.prepare`` on several
files with a trained BPE, then ``python -m trainer.train --arch llama --data DIR`` (real
processes; two ranks under ``mpiexec``).

- A run stopped after step 3 and resumed sees exactly the samples of the uninterrupted run: at
  the same dp its losses are the uninterrupted ones bit for bit (model, optimizer and sample
  order restored); at dp 2 they differ only by the order of the fp32 gradient sums, bounded as
  in tests/support/numerics.py (another sample would move the loss by far more).
- A blend of two datasets trains; a blend with another tokenizer is refused.
- The peak memory of a rank (start-up and every step) is the same within 20 MB for a 2 MB and
  a 500 MB token dataset: windows are read into the batch, nothing is mapped.
- ``--tensorboard`` writes event files that TensorBoard's reader reads back with the losses of
  ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from tests.support import PYTHON, REPO, dtrain_env
from tests.support.mpi_runs import run_ranks
from tests.support.numerics import U32, reduction_rtol
from tests.support.serial_reference import bounds, train_serially
from tests.trainer.test_dashboards import read_back
from trainer import checkpoint
from trainer.config.options import parse_args
from trainer.dashboards.names import NAMES
from trainer.data.prepare import main as prepare_main
from trainer.data.shard_writer import ShardWriter
from trainer.data.token_files import MANIFEST, TOKENIZER, Manifest, file_sha256, token_dtype
from trainer.inference.merge import load_serial
from trainer.inference.sampling import sample_ids
from trainer.training.metrics import read_records

VOCAB = 384
GLOBAL_BATCH = 8
FLAGS = ["--model", "llama-tiny", "--vocab-size", str(VOCAB), "--seq-len", "32",
         "--global-batch", str(GLOBAL_BATCH), "--lr", "3e-3", "--warmup-steps", "1",
         "--eval-every", "0", "--log-every", "1", "--seed", "3"]


def train(run_dir: Path, data: str, *extra: str, ranks: int = 1) -> list[dict]:
    args = ["-m", "trainer.train", *FLAGS, "--data", data, "--run-dir", str(run_dir), *extra]
    if ranks == 1:
        done = subprocess.run([PYTHON, *args], capture_output=True, text=True, cwd=REPO,
                              env=dtrain_env(), timeout=300, check=False)
    else:
        done = run_ranks(ranks, args)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return read_records(run_dir / "metrics.jsonl")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four text files of the standard library's sources, prepared with a trained BPE."""
    root = tmp_path_factory.mktemp("tokens")
    sources = sorted(Path(json.__file__).parent.glob("*.py")) + sorted(
        Path(shutil.__file__).parent.joinpath("email").glob("*.py"))[:3]
    assert prepare_main(["--input", *map(str, sources), "--out", str(root / "ds"),
                         "--train-bpe", str(VOCAB), "--quiet"]) == 0
    return root / "ds"


def test_a_run_resumed_at_the_same_or_another_dp_continues_the_uninterrupted_samples(
        corpus: Path, tmp_path: Path) -> None:
    whole = train(tmp_path / "whole", str(corpus), "--steps", "6")
    for ranks in (1, 2):
        run_dir = tmp_path / f"resumed-dp{ranks}"
        train(run_dir, str(corpus), "--steps", "6", "--stop-at", "3")
        meta = json.loads(next((run_dir / "checkpoints").glob("step-3/meta.json")).read_text())
        assert meta["data"]["samples"] == {"samples": 3 * GLOBAL_BATCH,
                                           "taken": [3 * GLOBAL_BATCH]}
        resumed = train(run_dir, str(corpus), "--steps", "6", "--resume", ranks=ranks)
        got = [r["loss"] for r in resumed if r["step"] > 3]
        want = [r["loss"] for r in whole if r["step"] > 3]
        if ranks == 1:
            assert got == want
        else:
            # fp32 as users run it: an fp32 serial run of the same data measures the
            # gradients' scale for the bounds (tests/support/numerics.py)
            ref = train_serially(parse_args([*FLAGS, "--data", str(corpus), "--steps", "6"],
                                            quiet=True), 6, fp64=False)
            tokens = GLOBAL_BATCH * 32 + 64
            atol = bounds(ref, steps=3, lr=3e-3, n_terms=tokens, unit=U32).loss
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                                       torch.tensor(want, dtype=torch.float64),
                                       rtol=reduction_rtol(tokens, U32), atol=atol)
    assert (tmp_path / "whole" / TOKENIZER).read_bytes() == (corpus / TOKENIZER).read_bytes()


def test_a_blend_trains_and_a_blend_of_other_tokenizers_is_refused(corpus: Path,
                                                                   tmp_path: Path) -> None:
    text = tmp_path / "more.txt"
    text.write_text(Path(json.__file__).read_text() * 2)
    assert prepare_main(["--input", str(text), "--out", str(tmp_path / "same"), "--tokenizer",
                         str(corpus / TOKENIZER), "--quiet"]) == 0
    records = train(tmp_path / "blend", f"{corpus}:0.7,{tmp_path / 'same'}:0.3", "--steps", "2")
    assert len(records) == 2
    assert prepare_main(["--input", str(text), "--out", str(tmp_path / "other"),
                         "--train-bpe", "300", "--quiet"]) == 0
    done = subprocess.run([PYTHON, "-m", "trainer.train", *FLAGS, "--steps", "1", "--data",
                           f"{corpus}:0.5,{tmp_path / 'other'}:0.5", "--run-dir",
                           str(tmp_path / "refused")], capture_output=True, text=True, cwd=REPO,
                          env=dtrain_env(), timeout=300, check=False)
    assert done.returncode == 2
    assert done.stderr.count("blended datasets have different tokenizers") == 1


def random_dataset(folder: Path, tokens: int, tokenizer: Path) -> Path:
    """``tokens`` random ids below VOCAB written straight into shards, with ``tokenizer``."""
    folder.mkdir()
    writer = ShardWriter(folder, token_dtype(VOCAB), 1 << 27)
    rng = np.random.default_rng(0)
    for start in range(0, tokens, 1 << 24):
        writer.add(rng.integers(0, VOCAB, min(1 << 24, tokens - start), dtype=np.uint16))
    writer.close()
    shutil.copyfile(tokenizer, folder / TOKENIZER)
    writer.files[TOKENIZER] = {"bytes": (folder / TOKENIZER).stat().st_size,
                               "sha256": file_sha256(folder / TOKENIZER)}
    (folder / MANIFEST).write_text(Manifest(VOCAB, 0, token_dtype(VOCAB).str,
                                            tuple(writer.shards), writer.documents,
                                            writer.files).to_json())
    return folder


# The trainer's start-up and three steps in one process: the peak RSS once the data is open,
# then the largest per-step peak (`trainer.parallel.zero.memory` resets the peak at every step).
MEASURE = """
import resource, sys
from pathlib import Path
from trainer.train import train
from trainer.training import startup
from trainer.training.metrics import read_records
world, cfg, data = startup.start(sys.argv[1:])
opened = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
train(cfg, world, data)
steps = max(r["peak_mem_bytes"] for r in read_records(Path(cfg.run_dir) / "metrics.jsonl"))
print(opened, steps)
"""


def peak_memory(data: Path, run_dir: Path) -> tuple[int, int]:
    done = subprocess.run([PYTHON, "-c", MEASURE, *FLAGS, "--steps", "3", "--eval-every", "3",
                           "--data", str(data), "--run-dir", str(run_dir)], capture_output=True,
                          text=True, cwd=REPO, env=dtrain_env(), timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    opened, steps = done.stdout.split()
    return int(opened), int(steps)


def test_a_ranks_peak_memory_does_not_grow_with_the_dataset(corpus: Path,
                                                            tmp_path: Path) -> None:
    small = random_dataset(tmp_path / "small", 1 << 20, corpus / TOKENIZER)  # 2 MiB
    big = random_dataset(tmp_path / "big", 250 << 20, corpus / TOKENIZER)  # 500 MiB
    try:
        assert (big / "tokens-00000.bin").stat().st_size == 1 << 28
        for a, b in zip(peak_memory(small, tmp_path / "run-small"),
                        peak_memory(big, tmp_path / "run-big"), strict=True):
            assert abs(a - b) < 20 * 2**20, (a, b)
    finally:
        shutil.rmtree(big)


def test_tensorboard_event_files_hold_the_logged_losses(corpus: Path, tmp_path: Path) -> None:
    records = train(tmp_path / "tb", str(corpus), "--steps", "3", "--tensorboard",
                    "--eval-every", "3")
    series = read_back(tmp_path / "tb" / "tensorboard")
    assert series[NAMES["loss"]] == [(r["step"], pytest.approx(r["loss"], rel=1e-6))
                                     for r in records]
    assert series[NAMES["val_loss"]] == [(3, pytest.approx(records[-1]["val_loss"], rel=1e-6))]
    assert {NAMES[k] for k in ("lr", "grad_norm", "tokens_per_s", "tflops")} <= set(series)


def test_generate_decodes_with_the_runs_tokenizer(corpus: Path, tmp_path: Path) -> None:
    train(tmp_path / "run", str(corpus), "--steps", "2")
    done = subprocess.run([PYTHON, "-m", "trainer.generate", "--run-dir", str(tmp_path / "run"),
                           "--prompt", "import json", "--tokens", "8", "--temperature", "1"],
                          capture_output=True, text=True, cwd=REPO, env=dtrain_env(),
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout.rstrip("\n")
    assert text.startswith("import json")
    # Decoded text, not the byte-level BPE's symbols for space and newline (Ġ, Ċ).
    assert not {"Ġ", "Ċ"} & set(text)
    tok = Tokenizer.from_file(str(tmp_path / "run" / TOKENIZER))
    model, _ = load_serial(checkpoint.latest(tmp_path / "run" / "checkpoints"))
    ids = tok.encode("import json", add_special_tokens=False).ids
    assert text == tok.decode(ids + sample_ids(model, ids, tokens=8, temperature=1.0, seed=0))


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_shard_stops_every_rank_with_one_message(corpus: Path, tmp_path: Path,
                                                           damage: str) -> None:
    """A shard shorter than its manifest says is refused at start-up; one whose bytes changed
    at the first global batch that touches it (its block's checksum, verified by every rank):
    either way one message, naming the file, and no rank left running."""
    folder = tmp_path / "ds"
    shutil.copytree(corpus, folder)
    shard = folder / "tokens-00000.bin"
    raw = bytearray(shard.read_bytes())
    if damage == "truncated":
        del raw[-2:]
    else:
        raw[100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    done = run_ranks(2, ["-m", "trainer.train", *FLAGS, "--steps", "2", "--data", str(folder),
                         "--run-dir", str(tmp_path / "run")])
    assert done.returncode != 0
    assert done.stdout.count("damaged tokenized dataset") == 1, done.stdout[-3000:]
    assert str(shard) in done.stdout
