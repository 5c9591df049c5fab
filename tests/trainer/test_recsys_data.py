"""The recommender's pure parts: the planted click log, the Criteo reader, batches, AUC, options."""

from __future__ import annotations

import pytest
import torch

from trainer.errors import ConfigError
from trainer.recsys.config import check_world, parse_args
from trainer.recsys.data import Batches, DataError, read_criteo, synthetic
from trainer.recsys.evaluate import auc

VOCAB = (100, 40)


def test_the_synthetic_log_is_the_same_for_the_same_seed_and_differs_for_another() -> None:
    a, b, c = (synthetic(10000, VOCAB, seed=s) for s in (3, 3, 4))
    assert torch.equal(a.sparse, b.sparse) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.sparse, c.sparse)
    assert int(a.sparse.min()) >= 0 and int(a.sparse[:, 1].max()) < VOCAB[1]


def test_synthetic_keys_follow_a_power_law() -> None:
    log = synthetic(20000, VOCAB, seed=1, zipf=1.1)
    counts = torch.bincount(log.sparse[:, 0], minlength=VOCAB[0]).sort(descending=True).values
    # Zipf(1.1) over 100 keys: the top key holds 1/H = 23% of the draws, key 10 ~ 1.8%.
    assert 0.19 < counts[0] / 20000 < 0.27 and counts[0] > 8 * counts[9]


def test_labels_follow_the_planted_model_whose_auc_is_the_ceiling() -> None:
    log = synthetic(20000, VOCAB, seed=2)
    assert abs(float(log.labels.mean() - log.truth.mean())) < 0.02
    assert auc(log.truth, log.labels) > 0.75


def test_auc_counts_ordered_pairs_and_halves_ties() -> None:
    scores = torch.tensor([0.1, 0.4, 0.35, 0.8, 0.4])
    labels = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0])
    pairs = [(p, n) for p in (2, 3, 4) for n in (0, 1)]
    want = sum(1.0 if scores[p] > scores[n] else 0.5 if scores[p] == scores[n] else 0.0
               for p, n in pairs) / len(pairs)
    assert auc(scores, labels) == pytest.approx(want)


def test_a_steps_batch_depends_on_seed_and_step_and_ranks_split_it() -> None:
    log = synthetic(1000, VOCAB, seed=5)
    whole = Batches(log, 64, seed=9).at(17)
    halves = [Batches(log, 64, seed=9, rank=r, size=2).at(17) for r in (0, 1)]
    assert torch.equal(torch.cat([h.sparse for h in halves]), whole.sparse)
    assert not torch.equal(Batches(log, 64, seed=9).at(18).sparse, whole.sparse)


def _criteo_line(label: str, ints: list[str], cats: list[str]) -> str:
    return "\t".join([label, *ints, *cats]) + "\n"


def test_criteo_rows_are_read_with_empty_fields_and_keys_taken_mod_the_vocabulary(tmp_path):
    path = tmp_path / "day.tsv"
    ints = ["3", "", "-2"] + ["0"] * 10
    cats = ["68fd1e64", ""] + ["0a"] * 24
    path.write_text(_criteo_line("1", ints, cats) + _criteo_line("0", ["1"] * 13, ["ff"] * 26))
    log = read_criteo(path, (1000,) * 26)
    assert log.labels.tolist() == [1.0, 0.0]
    assert log.dense[0, :3].tolist() == pytest.approx([1.3862944, 0.0, 0.0])
    assert log.sparse[0, :3].tolist() == [0x68FD1E64 % 1000, 0, 10]
    raw = read_criteo(path, (0,) * 26)  # hash mode: keys as they are
    assert int(raw.sparse[0, 0]) == 0x68FD1E64


def test_a_malformed_criteo_line_is_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "bad.tsv"
    path.write_text(_criteo_line("0", ["1"] * 13, ["a"] * 26) + "1\t2\t3\n")
    with pytest.raises(DataError, match=rf"malformed Criteo line \[{path}:2\]: 3 tab-separated "
                                        "fields, expected 40"):
        read_criteo(path, (10,) * 26)


def test_options_are_checked_before_training() -> None:
    with pytest.raises(ConfigError, match=r"\[--optimizer rmsprop\]: must be one of sgd, adagrad"):
        parse_args(["--optimizer", "rmsprop"], quiet=True)
    with pytest.raises(ConfigError, match=r"vocabulary sizes do not match the features"):
        parse_args(["--features", "3", "--vocab", "10,20"], quiet=True)
    with pytest.raises(ConfigError, match=r"global batch does not divide over the ranks "
                                          r"\[--global-batch 10, 4 rank\(s\)\]"):
        check_world(parse_args(["--global-batch", "10"], quiet=True), 4)
