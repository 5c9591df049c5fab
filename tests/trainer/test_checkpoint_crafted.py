"""Checkpoint files crafted by someone who rewrote the commit record too (so every checksum
matches): an index claiming more than its files hold, file names that leave the folder, files
that are devices or links. Each is one error naming the file, from ``trainer.generate``,
``trainer.export`` and ``--resume`` alike, in bounded memory and time: nothing is allocated or
read from a number the tensor files do not back."""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import PYTHON, REPO, dtrain_env
from tests.support.mpi_runs import forked_python
from trainer.checkpoint import checksum

FLAGS = ["--model", "llama-tiny", "--seq-len", "32", "--global-batch", "4", "--eval-every",
         "0", "--data-cap-mb", "0.25", "--log-every", "1", "--warmup-steps", "1"]
_MEMORY = 6 << 30  # address space a command may use: a runaway allocation fails, not the host


def _bounded() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_MEMORY, _MEMORY))


def command(*args: str, timeout: float = 180) -> tuple[int, str]:
    """A trainer command under a memory and a time limit: (exit status, output)."""
    done = subprocess.run([PYTHON, "-m", *args], capture_output=True, text=True, cwd=REPO,
                          env=dtrain_env(), timeout=timeout, check=False,
                          preexec_fn=_bounded)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama run with its checkpoint step-2."""
    run_dir = tmp_path_factory.mktemp("crafted") / "run"
    done = subprocess.run([*forked_python(), "-m", "trainer.train", *FLAGS, "--run-dir",
                           str(run_dir), "--steps", "2"], capture_output=True, text=True,
                          cwd=REPO, env=dtrain_env(), timeout=240, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return run_dir


def copy(archive: Path, tmp_path: Path) -> tuple[Path, Path]:
    run_dir = Path(shutil.copytree(archive, tmp_path / "run"))
    return run_dir, run_dir / "checkpoints" / "step-2"


def _digest(data: bytes) -> str:
    """The checksum a commit record of this dtrain holds for ``data``."""
    digest = checksum.new(checksum.WRITTEN)
    digest.update(data)
    return digest.hexdigest()


def rewrite(step: Path, name: str, data: bytes | None = None, *, size: int | None = None,
            digest: str | None = None) -> None:
    """Write ``data`` into ``step/name`` (when given) and make the commit record agree."""
    if data is not None:
        (step / name).write_bytes(data)
    record = json.loads((step / "COMMITTED").read_text())
    record["files"][name] = {
        "size": len(data) if size is None and data is not None else size,
        checksum.WRITTEN: digest or _digest(data or b"")}
    (step / "COMMITTED").write_text(json.dumps(record))


def three_ways(run_dir: Path, tmp_path: Path) -> dict[str, tuple[int, str]]:
    """What sampling, exporting and resuming the run say."""
    return {
        "generate": command("trainer.generate", "--run-dir", str(run_dir), "--prompt", "a",
                            "--tokens", "2"),
        "export": command("trainer.export", "--run-dir", str(run_dir), "--out",
                          str(tmp_path / "hf")),
        "resume": command("trainer.train", *FLAGS, "--run-dir", str(run_dir), "--steps", "3",
                          "--resume")}


def the_error(out: str) -> str:
    assert "Traceback" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, out[-3000:]
    return lines[0]


def test_an_index_entry_claiming_a_trillion_rows_is_one_error_before_anything_is_allocated(
        archive: Path, tmp_path: Path) -> None:
    run_dir, step = copy(archive, tmp_path)
    index = json.loads((step / "index.json").read_text())
    [(file, entries)] = index["files"].items()
    at, entry = next((i, e) for i, e in enumerate(entries) if len(e["shape"]) == 2)
    columns = entry["shape"][1]
    entry["shape"] = [10**12, columns]
    entry["tp"] = [1, 1, 0, 1]  # cut along the columns: one run per row, were it believed
    rewrite(step, "index.json", json.dumps(index).encode())
    for how, (code, out) in three_ways(run_dir, tmp_path).items():
        assert code == 2, (how, out[-3000:])
        line = the_error(out)
        assert line.startswith(f"error: checkpoint {step} is damaged [step-2/index.json, file "
                               f"'{file}', entry {at}]: its index does not match the tensor "
                               f"files: it claims {10**12 * columns:,} elements of "
                               f"{entry['name']}"), (how, line)
    assert not (tmp_path / "hf").exists()


def test_a_file_name_leaving_the_checkpoint_folder_is_refused_unread(
        archive: Path, tmp_path: Path) -> None:
    run_dir, step = copy(archive, tmp_path)
    outside = run_dir / "checkpoints" / "elsewhere.safetensors"
    shutil.copy(step / "rank-00000.safetensors", outside)
    index = json.loads((step / "index.json").read_text())
    index["files"] = {"../elsewhere.safetensors": index["files"]["rank-00000.safetensors"]}
    rewrite(step, "index.json", json.dumps(index).encode())
    rewrite(step, "../elsewhere.safetensors", outside.read_bytes())
    code, out = command("trainer.generate", "--run-dir", str(run_dir), "--prompt", "a",
                        "--tokens", "2")
    assert code == 2, out[-3000:]
    assert the_error(out).startswith(
        f"error: checkpoint {step} is damaged [file COMMITTED]: the commit record does not "
        "describe a checkpoint: it names the file '../elsewhere.safetensors', not a plain file "
        "name in the checkpoint folder. Restore the file from a copy"), out


@pytest.mark.parametrize("name", ["/dev/zero", "rank-00000.safetensors"])
def test_a_device_named_or_linked_in_the_commit_record_is_refused_without_reading_it(
        archive: Path, tmp_path: Path, name: str) -> None:
    run_dir, step = copy(archive, tmp_path)
    empty = _digest(b"")
    if name.startswith("/"):  # an absolute name
        rewrite(step, name, size=0, digest=empty)
        want = (f"error: checkpoint {step} is damaged [file COMMITTED]: the commit record "
                f"does not describe a checkpoint: it names the file '{name}', not a plain file "
                "name")
    else:  # the tensor file replaced by a link to a device of the size the record says
        (step / name).unlink()
        (step / name).symlink_to("/dev/zero")
        rewrite(step, name, size=0, digest=empty)
        want = (f"error: checkpoint {step} is damaged [file {name}]: it is a symbolic link, "
                "and is never followed")
    for how, (code, out) in three_ways(run_dir, tmp_path).items():
        assert code == 2, (how, out[-3000:])
        assert the_error(out).startswith(want), (how, out[-3000:])
