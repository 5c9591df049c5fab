"""Tokenized datasets: prepare writes what the tokenizer makes of the inputs, the loader's order
is DP-sharded, resumable at any dp and blended by weight, and damaged data is refused."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from trainer.data.batches import BatchPlan
from trainer.data.corpus import DataError
from trainer.data.prepare import main as prepare_main
from trainer.data.sources import DataSources, parse_data
from trainer.data.token_batches import Position, TokenBatches, permute
from trainer.data.token_files import MANIFEST, TokenFiles, file_sha256

SEQ = 16


def write_inputs(folder: Path) -> list[Path]:
    """Three text files and a JSON-lines file of two documents."""
    folder.mkdir()
    words = "the a fox jumps over lazy dog def return print 1 2 3 ( ) : + \n".split(" ")
    texts = [" ".join(random.Random(k).choices(words, k=400)) for k in range(3)]
    files = []
    for k, text in enumerate(texts):
        files.append(folder / f"doc{k}.txt")
        files[-1].write_text(text)
    files.append(folder / "more.jsonl")
    files[-1].write_text("\n".join(json.dumps({"text": t}) for t in ("héllo wörld", "bye")))
    return files


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("data")
    files = write_inputs(root / "in")
    assert prepare_main(["--input", *map(str, files), "--out", str(root / "ds"),
                         "--train-bpe", "300", "--shard-tokens", "500", "--quiet"]) == 0
    return root / "ds", files


def test_prepare_writes_every_document_then_eos_with_a_trained_bpe(
        dataset: tuple[Path, list[Path]]) -> None:
    folder, files = dataset
    data = TokenFiles(folder)
    m = data.manifest
    assert m.vocab_size == 300 and m.dtype == "<u2" and len(m.shards) > 1
    tokens = np.concatenate([data.window(k, 0, s.tokens) for k, s in enumerate(m.shards)])
    offsets = data.documents()
    assert offsets[-1] == len(tokens) and m.documents == len(offsets) - 1 == 5
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    docs = [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    assert all(doc[-1] == m.eos_id for doc in docs)
    assert [tok.decode(doc[:-1].tolist()) for doc in docs] == [
        *(f.read_text() for f in files[:3]), "héllo wörld", "bye"]
    for name, info in m.files.items():
        assert info["sha256"] == file_sha256(folder / name)


def test_a_vocabulary_over_65536_ids_is_stored_as_uint32(tmp_path: Path) -> None:
    vocab = {f"w{i}": i for i in range(70_000)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "a.txt").write_text("w69999 w5 w1")
    assert prepare_main(["--input", str(tmp_path / "a.txt"), "--out", str(tmp_path / "ds"),
                         "--tokenizer", str(tmp_path / "tok.json"), "--quiet"]) == 0
    data = TokenFiles(tmp_path / "ds")
    assert data.manifest.dtype == "<u4"
    assert data.window(0, 0, 4).tolist() == [69999, 5, 1, 70000]


def batches(folder: Path, *, dp: int, rank: int, blend: tuple[float, ...] = (1.0,),
            validation: bool = False) -> TokenBatches:
    return TokenBatches([(folder, w) for w in blend], seq_len=SEQ, plan=BatchPlan(8, dp, 2),
                        seed=5, dp_rank=rank, model_vocab=512, val_fraction=0.1,
                        validation=validation)


def rows(loaders: list[TokenBatches], step: int) -> list[list[int]]:
    """The global batch of ``step``: every DP rank's inputs, in rank order."""
    return [row for b in loaders for x, _ in b.microbatches(step) for row in x.tolist()]


def test_a_run_resumed_at_another_dp_sees_exactly_the_uninterrupted_samples(
        dataset: tuple[Path, list[Path]]) -> None:
    folder, _ = dataset
    blend = (0.7, 0.3)
    whole = [batches(folder, dp=2, rank=r, blend=blend) for r in range(2)]
    expected = [rows(whole, s) for s in range(8)]
    first = [batches(folder, dp=2, rank=r, blend=blend) for r in range(2)]
    seen = [rows(first, s) for s in range(3)]
    saved = json.loads(json.dumps(first[0].position.to_dict()))  # as a checkpoint keeps it
    resumed = [batches(folder, dp=4, rank=r, blend=blend) for r in range(4)]
    for b in resumed:
        b.restore(saved, 3)
    seen += [rows(resumed, s) for s in range(3, 8)]
    assert seen == expected


def test_an_epoch_visits_every_training_window_once_and_no_held_out_one(
        dataset: tuple[Path, list[Path]]) -> None:
    folder, _ = dataset
    loader = batches(folder, dp=1, rank=0)
    source = loader.sources[0]
    every = source.windows(np.arange(int(source.starts[-1])))
    starts = {tuple(row[:-1].tolist()): i for i, row in enumerate(every)}
    steps = source.train // 8
    drawn = [starts[tuple(row)] for s in range(steps) for row in rows([loader], s)]
    assert len(set(drawn)) == len(drawn) == steps * 8
    assert max(drawn) < source.train
    held_out = [starts[tuple(row)] for row in rows([batches(folder, dp=1, rank=0,
                                                            validation=True)], 0)]
    assert min(held_out) >= source.train


def test_blending_keeps_every_prefix_within_one_sample_of_the_weights(
        dataset: tuple[Path, list[Path]]) -> None:
    folder, _ = dataset
    loader = batches(folder, dp=1, rank=0, blend=(0.7, 0.2, 0.1))
    position = Position(0, [0, 0, 0])
    for step in range(10):
        loader.microbatches(step)
        position = loader.position
        assert all(abs(t - w * position.samples) <= 1
                   for t, w in zip(position.taken, loader.weights, strict=True))


def test_the_permutation_is_a_bijection_for_any_size() -> None:
    for n in (1, 2, 3, 5, 64, 1000, 4099):
        assert sorted(permute(np.arange(n, dtype=np.uint64), n, 7).tolist()) == list(range(n))


def copy_dataset(folder: Path, to: Path) -> Path:
    to.mkdir()
    for f in folder.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


def test_a_damaged_shard_is_refused_at_its_first_use_naming_file_and_block(
        dataset: tuple[Path, list[Path]], tmp_path: Path) -> None:
    folder = copy_dataset(dataset[0], tmp_path / "ds")
    shard = folder / "tokens-00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    data = TokenFiles(folder)  # opening reads no token
    data.window(0, 0, 10)
    with pytest.raises(DataError, match="tokens-00001.bin.*block 0 .*does not match"):
        data.window(1, 0, 10)


def test_every_dp_rank_meets_a_damaged_block_at_the_same_step_and_one_reports_it(
        dataset: tuple[Path, list[Path]], tmp_path: Path) -> None:
    """Each rank reads only its rows but verifies the blocks of the whole global batch: the
    ranks whose rows avoid the damage stop at the same step, so no rank waits in a collective
    and one message is printed."""
    folder = copy_dataset(dataset[0], tmp_path / "ds")
    shard = folder / "tokens-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    loaders = [TokenBatches([(folder, 1.0)], seq_len=SEQ, plan=BatchPlan(8, 4, 1), seed=5,
                            dp_rank=r, model_vocab=512, reporter=r == 0) for r in range(4)]
    failed_at: list[tuple[int, bool]] = []
    for loader in loaders:
        with pytest.raises(DataError, match="tokens-00000.bin.*block 0") as err:
            for step in range(100):
                loader.microbatches(step)
        failed_at.append((step, err.value.agreed and err.value.report))
    assert failed_at == [(failed_at[0][0], True)] + [(failed_at[0][0], False)] * 3


def test_a_truncated_shard_and_a_too_large_vocabulary_are_refused_when_opened(
        dataset: tuple[Path, list[Path]], tmp_path: Path) -> None:
    folder = copy_dataset(dataset[0], tmp_path / "ds")
    with pytest.raises(DataError, match=r"vocabulary has 300 ids, the model only 256"):
        TokenFiles(folder, model_vocab=256)
    shard = folder / "tokens-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"tokens-00000.bin\]: it has 998 bytes, the manifest "
                                        "says 1000"):
        TokenFiles(folder)
    (folder / MANIFEST).write_text("{}")
    with pytest.raises(DataError, match="invalid dataset manifest"):
        TokenFiles(folder)


def test_prepare_refuses_an_existing_output_and_leaves_it_alone(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture
                                                                ) -> None:
    files = write_inputs(tmp_path / "in")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "mine").write_text("keep")
    assert prepare_main(["--input", str(files[0]), "--out", str(tmp_path / "ds"),
                         "--train-bpe", "300", "--quiet"]) == 2
    assert "output folder exists" in capsys.readouterr().err
    assert (tmp_path / "ds" / "mine").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "in"]  # no temporary left


def test_data_names_text_one_dataset_or_a_weighted_blend(dataset: tuple[Path, list[Path]],
                                                         tmp_path: Path) -> None:
    folder = dataset[0]
    assert parse_data(None) == DataSources()
    assert parse_data(str(tmp_path)) == DataSources(text=str(tmp_path))
    assert parse_data(str(folder)) == DataSources(tokenized=((folder, 1.0),))
    assert parse_data(f"{folder}:0.7,{folder}:0.3").tokenized == ((folder, 0.7), (folder, 0.3))
    with pytest.raises(DataError, match=rf"not a tokenized dataset \[--data .*: {tmp_path}\]"):
        parse_data(f"{folder}:0.5,{tmp_path}:0.5")
    with pytest.raises(DataError, match="the weight must be a positive number"):
        parse_data(f"{folder}:-1")


def test_a_blend_of_datasets_from_different_tokenizers_is_refused(
        dataset: tuple[Path, list[Path]], tmp_path: Path) -> None:
    folder, files = dataset
    assert prepare_main(["--input", *map(str, files), "--out", str(tmp_path / "other"),
                         "--train-bpe", "280", "--quiet"]) == 0
    with pytest.raises(DataError, match="blended datasets have different tokenizers"):
        TokenBatches([(folder, 0.5), (tmp_path / "other", 0.5)], seq_len=SEQ,
                     plan=BatchPlan(8, 1, 1), seed=0, dp_rank=0, model_vocab=512)
