"""Helpers for tests that run `dtrain` as a user would: a real process, real ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from testbed.procfs import descendants, stat_fields

PYTHON = sys.executable
REPO = Path(__file__).resolve().parents[2]


def dtrain_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_"))}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(REPO)
    env.update(extra or {})
    return env


def dtrain_cmd(args: Sequence[str]) -> list[str]:
    return [PYTHON, "-m", "launcher", *args]


def run_dtrain(args: Sequence[str], *, timeout: float = 60, cwd: Path | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(dtrain_cmd(args), capture_output=True, text=True, timeout=timeout,
                          cwd=cwd or REPO, env=dtrain_env(env))


def start_dtrain(args: Sequence[str], *, cwd: Path | None = None,
                 env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(dtrain_cmd(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=cwd or REPO, env=dtrain_env(env))


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def wait_gone(pids: Iterable[int], timeout: float = 10.0) -> set[int]:
    """Wait until none of ``pids`` is alive; returns those still alive at the deadline."""
    pending = set(pids)
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        pending = {p for p in pending if alive(p)}
        if pending:
            time.sleep(0.1)
    return pending


def kill_recorded(pids: Iterable[int]) -> None:
    """Cleanup after a failed test: SIGKILL exactly the PIDs the test recorded."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stop_trees(pids: Iterable[int]) -> None:
    """SIGKILL the recorded processes and every descendant they started (their workers)."""
    pids = list(pids)
    kill_recorded([*pids, *(child for pid in pids for child in descendants(pid))])


def wait_for_lines(path: Path, count: int, timeout: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            lines = path.read_text().split()
            if len(lines) >= count:
                return lines
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not get {count} lines in {timeout}s")


#: The console script a user runs: its own directory, not the working directory, starts its path.
DTRAIN_SCRIPT = str(Path(PYTHON).parent / "dtrain")

#: Files that `plant_imposters` leaves in a folder; each writes one marker when imported.
IMPOSTERS = {"launcher/__init__.py": "launcher", "workerenv.py": "workerenv",
             "records.py": "records"}


def plant_imposters(folder: Path) -> Path:
    """A `launcher/` package, a `workerenv.py` and a `records.py` in ``folder``, as a shared
    directory or a user's project may hold them; importing any writes
    ``folder/IMPORTED-<name>``."""
    for rel, name in IMPOSTERS.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"open({str(folder / f'IMPORTED-{name}')!r}, 'w').close()\n")
    return folder


def imposters_imported(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("IMPORTED-*"))


def report_table(stderr: str) -> dict[int, str]:
    """The exit report's rows: rank -> its status (a cell wrapped onto more lines joined)."""
    rows: list[list[str]] = []
    for line in stderr.splitlines():
        if line.startswith("│ "):
            cells = [cell.strip() for cell in line.split("│")[1:-1]]
            if cells[0]:
                rows.append(cells)
            else:  # the same row, its long cells wrapped
                rows[-1] = [f"{old} {new}".strip() for old, new in zip(rows[-1], cells,
                                                                        strict=True)]
    return {int(row[0]): row[-1] for row in rows}


def run_with_link_cut(args: Sequence[str], *, ns: str, peer: str, ready: Path, go: Path,
                      timeout: float) -> tuple[int, str]:
    """Start ``dtrain args``; once a rank has written ``ready``, make every packet from the
    namespace host ``ns`` to the address ``peer`` vanish (``peer`` resolves to a hardware address
    nobody has) and write ``go``; then wait for the job. The link is restored and the job's
    PIDs killed whatever happens. Returns (exit code, stderr).

    While the job runs, ``ns``'s TCP send buffers may grow to SEND_BUFFER_CAP only: a send
    returns once the kernel has taken all its bytes, and at the default cap (4 MiB) a 4 MiB
    message sometimes fits whole, so the send the test means to stall returned at once now
    and then."""
    before = _tcp_wmem(ns)
    low, initial, _ = before.split()
    _tcp_wmem(ns, f"{low} {initial} {SEND_BUFFER_CAP}")
    proc = start_dtrain(args)
    try:
        deadline = time.monotonic() + timeout
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        subprocess.run(["ip", "-n", ns, "neigh", "replace", peer, "lladdr",
                        "02:00:00:00:00:01", "dev", "eth0", "nud", "permanent"], check=True)
        go.touch()
        _, err = proc.communicate(timeout=timeout)
    finally:
        subprocess.run(["ip", "-n", ns, "neigh", "del", peer, "dev", "eth0"], check=False)
        kill_recorded([proc.pid])
        _tcp_wmem(ns, before)
    return proc.returncode, err


# A quarter of the messages that `run_with_link_cut`'s tests stall (4 MiB).
SEND_BUFFER_CAP = 1 << 20


def _tcp_wmem(ns: str, value: str | None = None) -> str:
    """The namespace's TCP send-buffer sizes (min, default, max bytes); sets them first when
    ``value`` is given."""
    if value is not None:
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                        f"net.ipv4.tcp_wmem={value}"], check=True)
    return subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-n", "net.ipv4.tcp_wmem"],
                          check=True, capture_output=True, text=True).stdout.strip()
