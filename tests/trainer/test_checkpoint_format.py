"""The checkpoint file format across versions: the streamed safetensors writer against
safetensors' own reader, and a checkpoint of format 3 (sha256), committed in
``tests/fixtures/checkpoint-format3`` as the dtrain of commit cbb3918 wrote it, still loading
and verifying after format 4 (XXH3-128)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from trainer import checkpoint
from trainer.checkpoint import CheckpointDamaged, checksum
from trainer.checkpoint.files import write_tensors
from trainer.checkpoint.pieces import assemble
from trainer.config.options import parse_args
from trainer.training.resume import meta_of, run_meta

FIXTURE = Path(__file__).parents[1] / "fixtures" / "checkpoint-format3" / "step-4"


def fixture_tensor(shape: tuple[int, ...]) -> torch.Tensor:
    """What the fixture's writer saved for a tensor of ``shape`` (its parameter)."""
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) / 8


@pytest.fixture
def format3(tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "step-4"))


def test_a_checkpoint_written_before_the_change_loads_and_verifies_with_sha256(
        format3: Path) -> None:
    record, meta = checkpoint.read_meta(format3)
    assert json.loads((format3 / "COMMITTED").read_text())["format"] == 3
    assert {r.algorithm for r in record.values()} == {"sha256"} and meta["step"] == 4
    checkpoint.restore_rng(format3, record, meta)
    params, moments = assemble(format3), assemble(format3, "exp_avg")
    for name, shape in (("wte.weight", (4, 3)), ("ln_f.bias", (5,))):
        assert torch.equal(params[name], fixture_tensor(shape))
        assert torch.equal(moments[name], fixture_tensor(shape) + 0.5)


def test_a_flipped_bit_in_a_format_3_tensor_file_is_refused_before_use(format3: Path) -> None:
    shard = format3 / "rank-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x04  # inside the last tensor's bytes: safetensors would parse it happily
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointDamaged, match=r"\[file rank-00000\.safetensors\]: checksum "
                       r"mismatch \(sha256: written 28e364db8025\.\.\., read "):
        assemble(format3)


def test_a_format_3_record_with_an_xxh3_entry_is_damage(format3: Path) -> None:
    record = json.loads((format3 / "COMMITTED").read_text())
    record["files"]["meta.json"] = {"size": 1, "xxh3_128": "0" * 32}
    (format3 / "COMMITTED").write_text(json.dumps(record))
    with pytest.raises(CheckpointDamaged, match="its entry for 'meta.json' is not a size and a "
                       "sha256"):
        checkpoint.read_record(format3)


def test_the_streamed_tensor_file_reads_back_through_safetensors_for_every_dtype(
        tmp_path: Path) -> None:
    tensors = {"big": torch.randn(checksum.CHUNK // 4 * 2 + 77),  # three chunks, the last short
               "bf16": torch.randn(5, 3).bfloat16(), "half": torch.randn(2, 2).half(),
               "f64": torch.randn(3, dtype=torch.float64), "i64": torch.arange(4),
               "u8": torch.arange(6, dtype=torch.uint8).reshape(2, 3), "none": torch.empty(0, 4),
               "flag": torch.tensor([True, False]), "scalar": torch.tensor(2.5)}
    path = tmp_path / "t.safetensors"
    record = write_tensors(path, tensors)
    back = load_file(str(path))
    assert back.keys() == tensors.keys()
    assert all(back[k].dtype == t.dtype and torch.equal(back[k], t) for k, t in tensors.items())
    assert record.size == path.stat().st_size
    assert record.digest == checksum.of_file(path, "xxh3_128") and record.algorithm == "xxh3_128"
    assert (8 + int.from_bytes(path.read_bytes()[:8], "little")) % 4096 == 0  # data at a page


def test_a_dtype_safetensors_cannot_name_is_refused_before_anything_is_written(
        tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="a checkpoint cannot hold dtype torch.complex64"):
        write_tensors(tmp_path / "c.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)})
    assert not (tmp_path / "c.safetensors").exists()


def test_a_meta_built_with_the_run_part_kept_is_the_meta_built_anew() -> None:
    """A run keeps the part of meta.json that is the same at every save (`run_meta`); the
    body written is the same as without it."""
    cfg = parse_args(["--model", "small", "--tp", "2", "--pp", "2", "--dp", "2",
                      "--global-batch", "4", "--microbatches", "2"], quiet=True)
    args: dict[str, Any] = {"source": "corpus", "fingerprint": "f00d",
                            "optimizer": {"step": 7, "groups": [{"lr": 1e-3}]},
                            "samples": {"epoch": 1}}
    kept = run_meta(cfg)
    assert meta_of(cfg, 7, run_part=kept, **args) == meta_of(cfg, 7, **args)
    assert set(kept) < set(meta_of(cfg, 7, **args))
