"""What ``--data`` reads from disk: no more than the cap (plus the validation tail), however
large the file, and regular files only (a FIFO or a link to a device is skipped and listed,
never opened). Real processes of the trainer's start-up and of ``python -m trainer.train``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support import PYTHON, REPO, dtrain_env

MIB = 2**20
CAP_MB = 0.1
FLAGS = ["--model", "tiny", "--n-layer", "1", "--d-model", "32", "--seq-len", "32",
         "--global-batch", "4", "--steps", "1", "--warmup-steps", "1", "--eval-every", "0",
         "--data-cap-mb", str(CAP_MB)]

# The trainer's start-up (options, MPI world, data) in one process, then the bytes it read
# (rchar: every read() call) and its peak RSS. Not a whole `trainer.train` run: its per-step
# peak-memory readout resets the process's peak RSS (trainer.parallel.zero.memory).
MEASURE = """
import resource, sys
from trainer.training import startup
def read_so_far():
    return int(open("/proc/self/io").read().split("rchar:")[1].split()[0])
before = read_so_far()
ready = startup.start(sys.argv[1:])
assert not isinstance(ready, int), ready
print(read_so_far() - before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def start_up(data: Path, run_dir: Path) -> tuple[int, int]:
    """(bytes read, peak RSS in bytes) of the trainer's start-up on ``data``."""
    done = subprocess.run([PYTHON, "-c", MEASURE, *FLAGS, "--data", str(data), "--run-dir",
                           str(run_dir)], capture_output=True, text=True, cwd=REPO,
                          env=dtrain_env(), timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    read, peak = done.stdout.split()
    return int(read), int(peak)


def test_the_data_cap_bounds_what_is_read_and_held_however_large_the_file(
        tmp_path: Path) -> None:
    small, big = tmp_path / "small.txt", tmp_path / "big.txt"
    for path, size in ((small, 1 * MIB), (big, 200 * MIB)):  # sparse: no disk used
        with open(path, "wb") as fh:
            fh.truncate(size)
    read_small, peak_small = start_up(small, tmp_path / "run")
    read_big, peak_big = start_up(big, tmp_path / "run")
    # Both start-ups take the same 0.1 MiB (and its validation tail) of the same bytes, so
    # they read and hold the same; reading the big file whole costs 200 MiB of each.
    assert read_big - read_small < CAP_MB * MIB, (read_small, read_big)
    assert peak_big - peak_small < 32 * MIB, (peak_small, peak_big)


def train(*extra: str) -> tuple[int, str]:
    """``python -m trainer.train`` as a plain process (a hang ends at the timeout, killed)."""
    done = subprocess.run([PYTHON, "-m", "trainer.train", *FLAGS, *extra], capture_output=True,
                          text=True, cwd=REPO, env=dtrain_env(), timeout=90, check=False)
    return done.returncode, done.stdout + done.stderr


def test_only_regular_files_are_read_a_fifo_or_a_link_to_a_device_is_listed_not_opened(
        tmp_path: Path) -> None:
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    data.mkdir()
    elsewhere.mkdir()
    (elsewhere / "secret.txt").write_text("not part of the data\n")
    (data / "a.txt").write_text("plain training text\n" * 2000)
    os.mkfifo(data / "b.fifo")  # opening it would wait for a writer forever
    (data / "c.zero").symlink_to("/dev/zero")  # reading it would never end
    (data / "d").symlink_to(elsewhere)
    code, out = train("--data", str(data), "--run-dir", str(tmp_path / "run"))
    assert code == 0, out[-3000:]
    [warning] = [line for line in out.splitlines() if "not read" in line]
    assert warning == (
        f"warning: not read from the training data [{data / 'b.fifo'} (a FIFO), "
        f"{data / 'c.zero'} (a link to /dev/zero, a character device), {data / 'd'} (a link "
        f"to {elsewhere}, a folder)]: 3 entries are not regular files (or cannot be read); "
        "only regular files are read. Move them out of --data to silence this")
    assert f"data {data} (" in out


def test_a_data_path_that_is_a_fifo_is_refused_at_start_up(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    code, out = train("--data", str(tmp_path / "fifo"), "--run-dir", str(tmp_path / "run"))
    assert code == 2, out[-3000:]
    assert out.strip() == (f"error: data path is not a file or a folder [{tmp_path / 'fifo'}]: "
                           "it is a FIFO, and only regular files are read. Pass --data with a "
                           "text file or a folder of them")
