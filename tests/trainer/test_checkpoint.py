"""Checkpoints: atomic save, the commit record and its verification on load, newest-committed
resume, pruning (also of what a killed prune left), refusal of foreign checkpoints, and
bit-exact resume of ``python -m trainer.train`` (also after a save killed half-way)."""

from __future__ import annotations

import json
import pickle
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import xxhash

from tests.support import REPO, dtrain_env
from tests.support.mpi_runs import forked_python
from trainer import checkpoint
from trainer.checkpoint import CheckpointDamaged, CheckpointError
from trainer.checkpoint.pieces import Held, assemble, held, stage
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.optim.optimizer import build_optimizer
from trainer.placement import Placement
from trainer.training.metrics import read_records

TINY = GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8)
META = {"model": TINY.to_dict(), "layout": {"dp": 1, "tp": 1, "pp": 1}, "data": {"position": 0},
        "optimizer": {"step": 1, "groups": []}}


def state(seed: int = 0) -> tuple[GPT, list[Held]]:
    """A stepped model (so it has moments) and its tensors, each placed as on one process."""
    model = GPT(TINY, seed=seed)
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    model.loss(torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 8, dtype=torch.long)).backward()
    optimizer.step()
    for name, p in model.named_parameters():
        p.placement = Placement(name, tuple(p.shape))
    return model, held(model.parameters(), optimizer)


def save(root: Path, step: int, keep: int = 0) -> Path:
    _, tensors = state(step)
    staged, contents = stage(tensors, [True] * len(tensors))
    return checkpoint.save(root, step, tensors=staged, contents=contents, meta=META, keep=keep)


def load(path: Path) -> dict[str, torch.Tensor]:
    """Every file of the checkpoint read, verified; the parameters put together."""
    record, meta = checkpoint.read_meta(path)
    checkpoint.restore_rng(path, record, meta)
    return assemble(path)


def test_save_then_load_round_trips_weights_moments_and_meta(tmp_path: Path) -> None:
    model, tensors = state(3)
    staged, contents = stage(tensors, [True] * len(tensors))
    path = checkpoint.save(tmp_path, 7, tensors=staged, contents=contents, meta=META)
    assert path.name == "step-7" and checkpoint.read_meta(path)[1]["step"] == 7
    assert all(torch.equal(load(path)[n], p) for n, p in model.named_parameters())
    moments = assemble(path, "exp_avg")
    assert all(torch.equal(moments[h.placement.name], h.moments["exp_avg"]) for h in tensors)
    assert checkpoint.read_meta(path)[1]["layout"] == {"dp": 1, "tp": 1, "pp": 1}
    assert sorted(p.name for p in path.iterdir()) == [
        "COMMITTED", "index.json", "meta.json", "rank-00000.safetensors", "rng.safetensors"]


def test_latest_ignores_temporaries_and_folders_without_the_marker(tmp_path: Path) -> None:
    save(tmp_path, 2)
    (tmp_path / "step-9.tmp-abcd1234").mkdir()
    (tmp_path / "step-8").mkdir()  # renamed but never committed
    assert checkpoint.latest(tmp_path) == tmp_path / "step-2"
    assert checkpoint.latest(tmp_path / "absent") is None


def test_keep_prunes_the_oldest_checkpoints_and_dead_temporaries(tmp_path: Path) -> None:
    (tmp_path / "step-1.tmp-00ff00ff").mkdir(parents=True)
    for step in (1, 2, 3):
        save(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]


def test_loading_an_uncommitted_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "step-4").mkdir()
    with pytest.raises(CheckpointError, match=r"not a committed checkpoint \[.*step-4\]"):
        load(tmp_path / "step-4")


def test_checkpoint_of_another_model_config_is_refused_listing_every_difference() -> None:
    now = {**TINY.to_dict(), "n_layer": 3, "d_model": 32}
    with pytest.raises(CheckpointError) as err:
        checkpoint.check_compatible(META, model=now, path=Path("c/step-5"))
    text = str(err.value)
    assert text.startswith("checkpoint does not match this run [c/step-5]: differing fields:")
    assert "n_layer: checkpoint 1, now 3" in text and "d_model: checkpoint 16, now 32" in text


def test_the_vocabulary_padding_of_another_tp_is_not_another_model() -> None:
    checkpoint.check_compatible(META, model={**TINY.to_dict(), "vocab_multiple": 2},
                                path=Path("x"))


def test_the_commit_record_lists_every_file_with_its_size_and_xxh3_128(tmp_path: Path) -> None:
    path = save(tmp_path, 5)
    record = json.loads((path / "COMMITTED").read_text())
    assert record["format"] == checkpoint.FORMAT_VERSION == 4 and record["step"] == 5
    on_disk = {p.name: p.read_bytes() for p in path.iterdir() if p.name != "COMMITTED"}
    assert record["files"] == {name: {"size": len(data),
                                      "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
                               for name, data in on_disk.items()}


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize(("name", "damage", "why"), [
    ("rank-00000.safetensors", flip_bit,
     r"checksum mismatch \(xxh3_128: written [0-9a-f]{12}\.\.\., read [0-9a-f]{12}\.\.\.\): "
     "its bytes changed after the save"),
    ("rank-00000.safetensors", truncate,
     r"it has 100 bytes, the commit record [\d,]+ \(truncated"),
    ("index.json", empty, r"it has 0 bytes, the commit record [\d,]+ \(truncated"),
    ("rng.safetensors", empty, r"it has 0 bytes"),
    ("meta.json", flip_bit, "checksum mismatch"),
    ("rng.safetensors", Path.unlink, "the file is missing"),
], ids=["flipped-tensors", "truncated-tensors", "empty-index", "empty-rng", "flipped-meta",
        "missing-rng"])
def test_a_damaged_file_is_refused_on_load_naming_the_checkpoint_and_the_file(
        tmp_path: Path, name: str, damage: Callable[[Path], None], why: str) -> None:
    path = save(tmp_path, 3)
    damage(path / name)
    with pytest.raises(CheckpointDamaged) as err:
        load(path)
    text = str(err.value)
    assert text.startswith(f"checkpoint {path} is damaged [file {name}]: "), text
    assert re.search(why, text), text
    assert text.endswith("add --resume-fallback to resume from the newest checkpoint that "
                         "verifies")


def test_a_checkpoint_without_checksums_is_refused_with_the_format_named(tmp_path: Path
                                                                         ) -> None:
    path = save(tmp_path, 3)
    (path / "COMMITTED").write_text(json.dumps({"step": 3}))  # what format 1 wrote
    with pytest.raises(CheckpointError, match=r"checkpoint has no checksums \[.*COMMITTED\]: it "
                       r"is format 1, this dtrain reads formats 3 and 4"):
        load(path)


def test_a_pickled_checkpoint_of_format_2_is_refused_saying_what_to_do(tmp_path: Path) -> None:
    path = save(tmp_path, 3)
    digest = {"size": 1, "sha256": "0" * 64}
    (path / "COMMITTED").write_text(json.dumps({"format": 2, "step": 3, "files": {
        "meta.json": digest, "rng.pt": digest, "model-tp00-pp00.pt": digest}}))
    with pytest.raises(CheckpointError, match=r"checkpoint of an earlier format \[.*COMMITTED\]: "
                       r"it is format 2, whose files are pickles, and this dtrain never "
                       r"unpickles a checkpoint") as err:
        load(path)
    assert not isinstance(err.value, CheckpointDamaged)


@pytest.mark.parametrize(("body", "why"), [
    (b'{"format": 3, "files": {"rng.safetensors": 7}}', "its keys are 'files', 'format', not"),
    (b'{"format": 3, "step": 4, "files": {}}', "its step 4 is not the folder's"),
    (b'{"format": 3, "step": 3, "files": {"meta.json": 1, "index.json": 2, '
     b'"rng.safetensors": 3}}', "its entry for 'meta.json' is not a size and a sha256"),
    (b'[2, 3]', "it is a JSON list, not an object"),
    (b'{"format": 3, "st', "the commit record cannot be parsed"),
], ids=["no-step", "other-step", "bad-entry", "a-list", "cut-off"])
def test_a_garbled_commit_record_is_damage_not_a_crash(tmp_path: Path, body: bytes,
                                                       why: str) -> None:
    path = save(tmp_path, 3)
    (path / "COMMITTED").write_bytes(body)
    with pytest.raises(CheckpointDamaged, match=r"\[file COMMITTED\]: ") as err:
        load(path)
    assert why in str(err.value)


def test_a_commit_record_of_a_newer_format_is_refused_not_taken_for_damage(tmp_path: Path
                                                                          ) -> None:
    path = save(tmp_path, 3)
    record = json.loads((path / "COMMITTED").read_text())
    (path / "COMMITTED").write_text(json.dumps({**record, "format": 5}))
    with pytest.raises(CheckpointError, match=r"checkpoint of another format \[.*COMMITTED\]: "
                       r"its commit record says format 5, this dtrain reads formats 3 "
                       r"and 4") as err:
        load(path)
    assert not isinstance(err.value, CheckpointDamaged)


def test_a_folder_left_by_a_prune_killed_after_the_marker_delete_is_pruned_by_the_next_save(
        tmp_path: Path) -> None:
    """The prune of step 1 was killed after its marker went: the next saves must not crash
    on it (they did: a regex match was confused with a bool) and must delete it."""
    for step in (1, 2, 3):
        save(tmp_path, step)
    (tmp_path / "step-1" / "COMMITTED").unlink()
    (tmp_path / "step-9.tmp-0000abcd").mkdir()  # a later step's leftover: not ours to delete
    save(tmp_path, 4, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-4", "step-9.tmp-0000abcd"]


def test_save_killed_after_the_rename_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """DTRAIN_FAULT=save_after_rename: the folder is renamed but never gets its marker."""
    save(tmp_path, 2)
    code = ("import sys; from pathlib import Path; from tests.trainer.test_checkpoint import save; "
            "save(Path(sys.argv[1]), 4)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=False, cwd=REPO,
                          timeout=60,
                          env=dtrain_env({"DTRAIN_FAULT": "save_after_rename@4"}))
    assert done.returncode == -signal.SIGKILL
    assert (tmp_path / "step-4" / "meta.json").exists()
    assert not (tmp_path / "step-4" / "COMMITTED").exists()
    assert checkpoint.latest(tmp_path) == tmp_path / "step-2"


# -- end to end: python -m trainer.train ------------------------------------------------------

FLAGS = ["--model", "tiny", "--n-layer", "1", "--d-model", "32", "--seq-len", "32",
         "--global-batch", "4", "--microbatches", "2", "--dropout", "0.1", "--steps", "6",
         "--warmup-steps", "2", "--data-cap-mb", "0.25", "--log-every", "2"]


def train(run_dir: Path, *extra: str, fault: str = "") -> subprocess.CompletedProcess:
    env = dtrain_env({"DTRAIN_FAULT": fault} if fault else None)
    return subprocess.run([*forked_python(), "-m", "trainer.train", *FLAGS, "--run-dir",
                           str(run_dir), *extra], check=False, cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return assemble(checkpoint.latest(run_dir / "checkpoints"))


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_records(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    done = train(run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def test_resume_continues_bit_exactly(uninterrupted: Path, tmp_path: Path) -> None:
    first = train(tmp_path, "--stop-at", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    second = train(tmp_path, "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed at step 3" in second.stderr
    assert losses(tmp_path) == losses(uninterrupted)  # dropout on: the RNG stream resumes too
    ref = final_state(uninterrupted)
    assert all(torch.equal(v, ref[k]) for k, v in final_state(tmp_path).items())


def test_training_killed_mid_save_resumes_from_the_previous_checkpoint(
        uninterrupted: Path, tmp_path: Path) -> None:
    killed = train(tmp_path, "--save-every", "2", fault="save_after_meta@4")
    assert killed.returncode == -signal.SIGKILL
    ckpts = tmp_path / "checkpoints"
    assert any(p.name.startswith("step-4.tmp-") for p in ckpts.iterdir())
    assert checkpoint.latest(ckpts) == ckpts / "step-2"
    resumed = train(tmp_path, "--save-every", "2", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step 2" in resumed.stderr
    assert losses(tmp_path) == losses(uninterrupted)
    ref = final_state(uninterrupted)
    assert all(torch.equal(v, ref[k]) for k, v in final_state(tmp_path).items())
    assert not any(".tmp-" in p.name for p in ckpts.iterdir())  # the dead temporary was pruned


def test_resume_with_another_model_is_refused_naming_the_fields(uninterrupted: Path) -> None:
    done = train(uninterrupted, "--resume", "--d-model", "64")
    assert done.returncode == 2
    assert "checkpoint does not match this run" in done.stderr
    assert "d_model: checkpoint 32, now 64" in done.stderr


def test_run_dir_holds_metrics_plot_and_the_meta_of_the_run(uninterrupted: Path) -> None:
    records = read_records(uninterrupted / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "tokens_per_s", "compute_s", "comm_exposed_s"} <= records[0].keys()
    assert (uninterrupted / "loss.png").read_bytes()[:4] == b"\x89PNG"
    meta = json.loads((uninterrupted / "checkpoints" / "step-6" / "meta.json").read_text())
    assert meta["data"]["position"] == 6 and meta["config"]["microbatches"] == 2


def test_a_checkpoint_is_read_with_pickle_unusable_whatever_torch_is_told(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = state(3)
    path = save(tmp_path, 3)

    def unusable(*_: object, **__: object) -> None:
        raise AssertionError("something unpickled")

    for owner, name in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"),
                        (torch, "load")):
        monkeypatch.setattr(owner, name, unusable)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    assert all(torch.equal(load(path)[n], p) for n, p in model.named_parameters())
