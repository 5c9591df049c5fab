"""The documentation site builds strictly, its reference pages are what the code generates, and
every command the README and docs/ show uses only options the code has."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.docs_commands import ROOT, Command, commands

CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"
PROGRAM_STARTS = ("python", "python3", "bash", "sh", "env", "torchrun", "./train.py")
PASSES_ON = {"python -m trainer.plan": "python -m trainer.train"}
"""Commands that take another command's flags too (the planner takes the trainer's)."""


def _generator():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def known_flags() -> dict[str, set[str]]:
    """Each command's options, read from the generated command-line reference."""
    flags: dict[str, set[str]] = {}
    for name, body in re.findall(r"^## `([^`]+)`\n\n```text\n(.*?)\n```", CLI_PAGE.read_text(),
                                 flags=re.M | re.S):
        flags[name] = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", body))
    for name, other in PASSES_ON.items():
        if name in flags:
            flags[name] |= flags[other]
    return flags


def _split_program(words: list[str]) -> tuple[list[str], list[str]]:
    """A `dtrain` command's own words and its program's (after `--` or the program's name)."""
    if "--" in words:
        at = words.index("--")
        return words[:at], words[at + 1:]
    for at, word in enumerate(words):
        if word in PROGRAM_STARTS or word.endswith(".py"):
            return words[:at], words[at:]
    return words, []


def _options(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("-") and w != "-"
            and not re.fullmatch(r"-\d.*", w)]


def stale_options(command: Command, flags: dict[str, set[str]]) -> list[str]:
    """The options of ``command`` that the command it runs does not have."""
    words = command.argv()
    checks: list[tuple[str, list[str]]] = []
    if words[0] == "dtrain":
        sub = words[1] if len(words) > 1 and f"dtrain {words[1]}" in flags else ""
        own, program = _split_program(words[2 if sub else 1:])
        checks.append((f"dtrain {sub}".strip(), own))
        words = program
    if words[:2] in (["python", "-m"], ["python3", "-m"]) and len(words) > 2 \
            and f"python -m {words[2]}" in flags:
        checks.append((f"python -m {words[2]}", words[3:]))
    return [f"{name} has no {opt}" for name, words in checks for opt in _options(words)
            if opt not in flags[name]]


def test_the_site_builds_strictly_with_every_page_in_the_navigation(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-d", str(tmp_path / "site")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()


@pytest.mark.timeout(600)
def test_the_reference_pages_are_what_the_code_generates() -> None:
    for path, text in _generator().pages().items():
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)} is stale: run `python docs/generate.py` and commit it")


def test_every_documented_command_uses_only_options_its_command_has() -> None:
    flags = known_flags()
    assert {"dtrain launch", "dtrain check", "python -m trainer.train"} <= set(flags)
    shown = commands()
    assert len(shown) > 30  # the pages show commands; an empty scan would pass vacuously
    stale = [f"{c.where}: {problem}" for c in shown for problem in stale_options(c, flags)]
    assert not stale, "\n".join(stale)


def test_a_renamed_flag_in_a_page_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("Train:\n\n    dtrain launch --nproc-per-node 2 -- python -m trainer.train "
                    "--model tiny --tensor-parallel 2\n\nand `dtrain launch --max-restart 3 "
                    "-- python x.py`.\n")
    problems = [p for c in commands([page]) for p in stale_options(c, known_flags())]
    assert problems == ["python -m trainer.train has no --tensor-parallel",
                        "dtrain launch has no --max-restart"]


NOT_RUN = re.compile(r"<!-- docs: not run: (.+?) -->")
PLACEHOLDER = re.compile(r"\.\.\.|<[a-z-]+>|\b[A-Z]{3,}\b")


def runnable_launches() -> list[Command]:
    """The documented `dtrain launch` commands of code blocks with a whole program, those after
    a ``<!-- docs: not run: why -->`` marker and those with placeholders excepted."""
    out = []
    for command in commands():
        words = command.argv()
        lines = command.page.read_text().splitlines()
        if words[:2] == ["dtrain", "launch"] and "--" in words and len(words) > 3 \
                and not PLACEHOLDER.search(command.text) \
                and lines[command.line - 1].startswith("    ") \
                and not NOT_RUN.search(_before_block(lines, command.line - 1)):
            out.append(command)
    return out


def _before_block(lines: list[str], index: int) -> str:
    """The first line above the indented code block that holds line ``index``."""
    while index > 0 and (lines[index - 1].startswith("    ") or not lines[index - 1].strip()):
        index -= 1
    return lines[index - 1] if index > 0 else ""


def test_every_documented_launch_is_accepted_as_written(tmp_path: Path) -> None:
    """Each launch a page shows, run with ``--dry-run`` where its hostfile exists: the hosts, the
    ranks and their environment are planned without an error (nothing starts)."""
    (tmp_path / "hostfiles").mkdir()
    (tmp_path / "hostfiles" / "cluster").write_text(
        (ROOT / "hostfiles" / "cluster.example").read_text())
    (tmp_path / "hosts").write_text("node1 slots=2\nnode2 slots=2\n")
    shown = runnable_launches()
    assert len(shown) >= 8
    dtrain = Path(sys.executable).with_name("dtrain")
    failed = []
    for command in shown:
        words = command.argv()
        done = subprocess.run([str(dtrain), "launch", "--dry-run", *words[2:]], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            failed.append(f"{command.where}: exit {done.returncode}: {done.stderr.strip()}")
    assert not failed, "\n".join(failed)
