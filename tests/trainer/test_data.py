"""Byte corpus and deterministic, DP-sharded batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.data.batches import BatchPlan, ShardedBatches, check_splits, window_starts
from trainer.data.corpus import DataError, check_vocab, load_corpus, stdlib_dir

CAP = 64 * 1024


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(cap_bytes=CAP)


def batches(corpus, *, dp: int = 1, rank: int = 0, micro: int = 1, seed: int = 3,
            batch: int = 8) -> ShardedBatches:
    return ShardedBatches(corpus, seq_len=16, plan=BatchPlan(batch, dp, micro), seed=seed,
                          dp_rank=rank)


def test_default_corpus_is_the_stdlib_python_source_read_deterministically(corpus) -> None:
    again = load_corpus(cap_bytes=CAP)
    assert corpus.source == str(stdlib_dir()) and len(corpus.train) == CAP
    assert corpus.fingerprint == again.fingerprint
    assert b"def " in corpus.tokens.numpy().tobytes()


def test_a_folder_corpus_reads_files_in_sorted_order_and_folders_after_files(tmp_path) -> None:
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("hidden")
    (tmp_path / ".notes").write_text("hidden")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("third")
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    text = load_corpus(str(tmp_path)).tokens.numpy().tobytes()
    assert text == b"first\n\nsecond\n\nthird\n\n"


def test_the_cap_limits_the_training_split_of_a_file_corpus(tmp_path: Path) -> None:
    (tmp_path / "big.txt").write_text("x" * 1000)
    corpus = load_corpus(str(tmp_path / "big.txt"), cap_bytes=100, val_fraction=0.2)
    assert (len(corpus.train), len(corpus.val)) == (100, 25)  # validation is read past the cap


def test_a_missing_data_path_is_named_in_the_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data path not found \[.*nowhere\]: it does not exist"):
        load_corpus(str(tmp_path / "nowhere"))


def test_a_corpus_shorter_than_a_window_is_refused_with_the_sizes(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("tiny")
    with pytest.raises(DataError, match=r"training data too small \[6 bytes\].*seq_len\+1 = 17"):
        batches(load_corpus(str(tmp_path / "t.txt")))


def test_a_step_batch_depends_only_on_seed_and_step(corpus) -> None:
    a, b = batches(corpus), batches(corpus)
    b.global_batch(9)  # other queries in between change nothing: there is no iterator state
    assert torch.equal(a.global_batch(4)[0], b.global_batch(4)[0])
    assert not torch.equal(a.global_batch(4)[0], a.global_batch(5)[0])
    assert not torch.equal(a.global_batch(4)[0], batches(corpus, seed=4).global_batch(4)[0])


def test_targets_are_the_inputs_shifted_by_one_byte(corpus) -> None:
    x, y = batches(corpus).global_batch(1)
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("dp, micro", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_dp_ranks_get_disjoint_slices_that_rebuild_the_global_batch(corpus, dp, micro) -> None:
    whole = batches(corpus).global_batch(7)[0]
    parts = [x for r in range(dp)
             for x, _ in batches(corpus, dp=dp, rank=r, micro=micro).microbatches(7)]
    assert len(parts) == dp * micro and all(p.shape[0] == 8 // (dp * micro) for p in parts)
    assert torch.equal(torch.cat(parts), whole)


def test_an_uneven_batch_split_is_refused() -> None:
    with pytest.raises(ValueError, match=r"not divisible by dp\*microbatches \(4\*3=12\)"):
        BatchPlan(global_batch=8, dp=4, microbatches=3)


def test_window_starts_stay_inside_the_corpus() -> None:
    starts = window_starts(1, 2, global_batch=1000, seq_len=16, corpus_len=40)
    assert int(starts.min()) >= 0 and int(starts.max()) + 17 <= 40


def test_an_empty_data_folder_is_refused_naming_the_folder(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"no training data \[.*\]: the folder has no non-empty"):
        load_corpus(str(tmp_path))


def test_a_cap_of_zero_bytes_is_refused() -> None:
    with pytest.raises(DataError, match=r"no training data \[cap 0 bytes\]"):
        load_corpus(cap_bytes=0)


def test_binary_files_are_read_and_listed_text_files_are_not(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("plain text, \u00fcn\u00efc\u00f6d\u00e9 too")
    (tmp_path / "b.bin").write_bytes(b"PK\x03\x04\x00\x00")
    (tmp_path / "c.dat").write_bytes(b"\xff\xfe not utf-8")
    corpus = load_corpus(str(tmp_path))
    assert corpus.binary_files == (str(tmp_path / "b.bin"), str(tmp_path / "c.dat"))
    assert b"PK\x03\x04" in corpus.tokens.numpy().tobytes()


def test_a_vocabulary_smaller_than_the_bytes_is_refused_at_the_first_byte_by_file_and_line(
        tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("ascii only\n")
    (tmp_path / "b.txt").write_text("line one\nline two\nna\u00efve\n")
    corpus = load_corpus(str(tmp_path))
    check_vocab(corpus, 256)
    with pytest.raises(DataError, match=r"vocabulary too small for the data \[--vocab-size 128; "
                       r"byte 195 at .*b\.txt:3\]: .*bytes up to 195.*Use --vocab-size 256"):
        check_vocab(corpus, 128)


def test_the_validation_split_is_the_tail_and_no_window_of_either_split_crosses_it() -> None:
    corpus = load_corpus(cap_bytes=CAP, val_fraction=0.25)
    cut = CAP
    assert corpus.val_bytes == CAP // 3 and len(corpus.train) == cut
    train = batches(corpus, batch=64)
    whole = corpus.tokens
    for step in range(1, 20):
        x, _ = train.global_batch(step)
        starts = window_starts(3, step, global_batch=64, seq_len=16, corpus_len=cut)
        assert int(starts.max()) + 17 <= cut
        assert torch.equal(x[5], whole[int(starts[5]):int(starts[5]) + 16].long())
    val = ShardedBatches(corpus, seq_len=16, plan=BatchPlan(64, 1, 1), seed=3, dp_rank=0,
                         validation=True)
    vx, _ = val.global_batch(0)
    assert torch.equal(vx, val.global_batch(0)[0])  # the same windows at every evaluation
    tail = whole[cut:].numpy().tobytes()
    assert all(bytes(row.tolist()) in tail for row in vx)


def test_a_validation_split_too_small_for_a_window_is_refused_with_the_fix(tmp_path) -> None:
    (tmp_path / "t.txt").write_text("x" * 200)  # below the cap: split 5 : 95
    corpus = load_corpus(str(tmp_path / "t.txt"), val_fraction=0.05)
    check_splits(corpus, 16, validation=False)
    with pytest.raises(DataError, match=r"validation data too small \[10 bytes\].*--val-fraction"):
        check_splits(corpus, 16, validation=True)
