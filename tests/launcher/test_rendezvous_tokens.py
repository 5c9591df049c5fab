"""`dtrain token new` as a user runs it: redirected into a file by a real shell (umask 022, so
the shell creates the file readable by everyone), given a file name, or piped on; every token
it writes is one the head and the agents accept, and none is ever readable by others."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from launcher.rendezvous import tokens
from launcher.rendezvous.options import read_token
from tests.support import PYTHON, REPO, dtrain_env, run_dtrain


def _shell(line: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``line`` in sh with umask 022 and this venv's `dtrain` on PATH."""
    path = f"{Path(PYTHON).parent}:{os.environ['PATH']}"
    return subprocess.run(["sh", "-c", f"umask 022 && {line}"], capture_output=True, text=True,
                          cwd=cwd, env=dtrain_env({"PATH": path}), timeout=60)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_dtrain_token_new_redirected_to_a_file_leaves_an_owner_only_token_the_head_accepts(
        tmp_path: Path) -> None:
    done = _shell("dtrain token new > token", tmp_path)
    assert done.returncode == 0, done.stderr
    assert _mode(tmp_path / "token") == 0o600  # the shell made it 0644; dtrain fixed it first
    assert tokens.why_not(read_token(str(tmp_path / "token")).decode()) == ""


def test_dtrain_token_new_file_creates_it_owner_only_and_never_writes_over_a_token(
        tmp_path: Path) -> None:
    token = tmp_path / "token"
    assert run_dtrain(["token", "new", str(token)]).returncode == 0
    first = token.read_text()
    assert _mode(token) == 0o600 and read_token(str(token))
    again = run_dtrain(["token", "new", str(token)])
    assert again.returncode == 2 and "the token file exists" in again.stderr
    assert token.read_text() == first
    assert first.strip() not in again.stderr + again.stdout


def test_dtrain_token_new_appended_to_a_file_that_holds_something_is_refused(
        tmp_path: Path) -> None:
    (tmp_path / "notes").write_text("my notes\n")
    done = _shell("dtrain token new >> notes", tmp_path)
    assert done.returncode == 2 and "standard output is a file that is not empty" in done.stderr
    assert (tmp_path / "notes").read_text() == "my notes\n"


def test_dtrain_token_new_piped_on_writes_one_line_and_two_runs_differ(tmp_path: Path) -> None:
    first, second = (_shell("dtrain token new | cat", tmp_path).stdout for _ in range(2))
    assert first != second and first.endswith("\n") and first.count("\n") == 1
    assert tokens.why_not(first.strip()) == ""


def test_the_kubernetes_recipes_token_line_run_as_written_makes_a_token_the_head_accepts(
        tmp_path: Path) -> None:
    text = (REPO / "examples" / "kubernetes" / "jobset-rendezvous.yaml").read_text()
    [line] = [line[1:].split("#")[0].strip() for line in text.splitlines()
              if line.startswith("#   dtrain token new")]
    assert _shell(line, tmp_path).returncode == 0
    assert read_token(str(tmp_path / "token"))
