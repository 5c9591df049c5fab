"""Checkpoint files written with direct I/O (`trainer.checkpoint.direct`) hold exactly the bytes
given, whatever the pieces' sizes and addresses, and the staged host copies lie as the file
does (`trainer.checkpoint.pieces.stage`)."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from trainer.checkpoint import checksum
from trainer.checkpoint.direct import ALIGN, BOUNCE, DirectFile
from trainer.checkpoint.files import Images, write_tensors
from trainer.checkpoint.pieces import Held, stage
from trainer.placement import Placement


def _pieces(seed: int) -> list[memoryview]:
    """Byte pieces of awkward sizes: aligned and not, empty, several bounce buffers long,
    slices of one block (so some start aligned after unaligned ones) and loose bytes."""
    rng = random.Random(seed)
    block = torch.randint(0, 256, (3 * BOUNCE + 5 * ALIGN,), dtype=torch.uint8)
    view = memoryview(block.numpy())
    cuts = sorted(rng.sample(range(1, len(view)), 12) + [0, ALIGN, 2 * ALIGN, len(view)])
    pieces = [view[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    return [memoryview(b"header"), *pieces[:5], memoryview(b""),
            memoryview(bytes(rng.randrange(256) for _ in range(ALIGN + 3))), *pieces[5:]]


def _write(path: Path, pieces: list[memoryview], *, buffered_after: int | None = None) -> None:
    out = DirectFile(path)
    try:
        for i, piece in enumerate(pieces):
            if i == buffered_after:
                out._buffered()  # as when the filesystem refuses a direct write midway
            out.write(piece)
        out.finish()
    finally:
        out.close()


def test_a_direct_file_holds_exactly_the_pieces_given_in_order(tmp_path: Path) -> None:
    for seed in range(3):
        pieces = _pieces(seed)
        _write(tmp_path / "f.bin", pieces)
        assert (tmp_path / "f.bin").read_bytes() == b"".join(bytes(p) for p in pieces)


def test_a_direct_file_that_falls_back_to_buffered_midway_holds_the_same_bytes(
        tmp_path: Path) -> None:
    pieces = _pieces(7)
    _write(tmp_path / "f.bin", pieces, buffered_after=4)
    assert (tmp_path / "f.bin").read_bytes() == b"".join(bytes(p) for p in pieces)


def _held(shapes: list[tuple[int, ...]]) -> list[Held]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, shape in enumerate(shapes):
        t = torch.randn(shape, generator=gen)
        out.append(Held(t, Placement(f"w{i}", tuple(shape)),
                        {"exp_avg": torch.randn(shape, generator=gen),
                         "exp_avg_sq": torch.rand(shape, generator=gen)}))
    return out


def test_staged_host_copies_are_one_page_aligned_block_in_the_files_order() -> None:
    held = _held([(3, 5), (1000,), (7,), (64, 64)])
    pool: dict[str, torch.Tensor] = {}
    staged, _ = stage(held, [True] * len(held), pool)
    tensors = list(staged.values())
    assert tensors[0].data_ptr() % ALIGN == 0
    for before, after in zip(tensors, tensors[1:], strict=False):
        assert after.data_ptr() == before.data_ptr() + before.numel() * before.element_size()
    again, _ = stage(held, [True] * len(held), pool)  # the next save reuses the block
    assert [t.data_ptr() for t in again.values()] == [t.data_ptr() for t in tensors]


def test_a_staged_tensor_file_reads_back_and_its_record_matches_its_bytes(
        tmp_path: Path) -> None:
    held = _held([(3, 5), (1000,), (7,), (300, 70), (1,)])
    staged, _ = stage(held, [True] * len(held), {})
    record = write_tensors(tmp_path / "r.safetensors", staged)
    back = load_file(tmp_path / "r.safetensors")
    assert list(back) == list(staged)
    for key, tensor in staged.items():
        assert torch.equal(back[key], tensor)
    assert record.size == (tmp_path / "r.safetensors").stat().st_size
    assert record.digest == checksum.of_file(tmp_path / "r.safetensors", checksum.WRITTEN)


def test_a_staged_block_goes_to_the_disk_in_one_write_with_the_header(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A direct write is a round trip to the disk: the header and the staged tensors, back to
    back in one block, are written in one system call (the header, the block's whole pages),
    then the rest of its last page through the page cache, not one or two writes per tensor
    nor one for the header, and the file is never cut back (cutting inside a block reads it
    back from the disk); the bytes are the same."""
    held = _held([(3, 5), (1000,), (7,), (300, 70), (1,), (64, 64)])
    staged, _ = stage(held, [True] * len(held), {})
    calls: list[list[int]] = []  # the sizes of each call's parts
    writev = os.writev

    def counted(fd: int, parts: Any) -> int:
        calls.append([len(part) for part in parts])
        return writev(fd, parts)

    monkeypatch.setattr(os, "writev", counted)
    cuts: list[int] = []
    monkeypatch.setattr(os, "ftruncate", lambda fd, size: cuts.append(size))
    record = write_tensors(tmp_path / "r.safetensors", staged)
    monkeypatch.undo()
    back = load_file(tmp_path / "r.safetensors")
    assert all(torch.equal(back[key], tensor) for key, tensor in staged.items())
    assert record.digest == checksum.of_file(tmp_path / "r.safetensors", checksum.WRITTEN)
    header = Images()(staged).header
    data = sum(t.numel() * t.element_size() for t in staged.values())
    assert data % ALIGN  # the file's end is not a whole block
    assert cuts == []
    direct = [[len(header), data - data % ALIGN], [data % ALIGN]]
    buffered = [[len(header)], [data]]  # a filesystem that refuses direct I/O: as given
    assert calls in (direct, buffered), calls


def test_a_save_into_the_same_staged_tensors_keeps_their_layout_and_writes_its_new_values(
        tmp_path: Path) -> None:
    """A run stages every save into the same host tensors: the file's header and runs are
    worked out once (`files.Images`), and each file still holds that save's values."""
    held = _held([(3, 5), (1000,), (7,), (300, 70)])
    pool: dict[str, torch.Tensor] = {}
    images = Images()
    staged, _ = stage(held, [True] * len(held), pool)
    first = images(staged)
    write_tensors(tmp_path / "a.safetensors", staged, images=images)
    for h in held:  # the next save's values, into the same host tensors
        h.tensor.mul_(-2.0)
    again, _ = stage(held, [True] * len(held), pool)
    assert images(again) is first
    record = write_tensors(tmp_path / "b.safetensors", again, images=images)
    back = load_file(tmp_path / "b.safetensors")
    assert all(torch.equal(back[f"param/w{i}"], h.tensor.reshape(-1))
               for i, h in enumerate(held))
    assert record.digest == checksum.of_file(tmp_path / "b.safetensors", checksum.WRITTEN)
    assert (tmp_path / "b.safetensors").read_bytes()[:len(first.header)] == first.header


def test_a_kept_layout_is_worked_out_anew_for_other_tensors(tmp_path: Path) -> None:
    images = Images()
    small, _ = stage(_held([(3, 5), (7,)]), [True, True], {})
    other, _ = stage(_held([(3, 5), (9,)]), [True, True], {})
    kept = images(small)
    assert images(other) is not kept
    record = write_tensors(tmp_path / "o.safetensors", other, images=images)
    back = load_file(tmp_path / "o.safetensors")
    assert all(torch.equal(back[key], t) for key, t in other.items())
    assert record.size == (tmp_path / "o.safetensors").stat().st_size
    renamed = {f"{key}x": t for key, t in other.items()}  # the same tensors, other names
    assert images(renamed).header != images(other).header
