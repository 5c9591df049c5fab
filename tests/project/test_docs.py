"""The documentation site builds strictly, its reference pages are what the code generates, and
every command the README and docs/ show uses only options the code has."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.support.docs_commands import ROOT, Command, Plan, commands, plans

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


def _run(plan: Plan, cwd: Path, env: dict[str, str]) -> str:
    """Run one documented command in ``cwd``; "" when it succeeded, else what went wrong."""
    words = list(plan.argv)
    out = None
    if ">" in words:  # `dtrain token new > token`: the shell's redirection, done here
        at = words.index(">")
        words, out = words[:at], cwd / words[at + 1]
    bin_dir = Path(sys.executable).parent
    if words[0] in ("python", "python3"):
        words[0] = sys.executable
    elif words[0] == "dtrain":
        words[0] = str(bin_dir / "dtrain")
    done = subprocess.run(words, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    if out is not None:
        out.write_text(done.stdout)
    if done.returncode != 0:
        return (f"{plan.command.where}: `{' '.join(plan.argv)}` exit {done.returncode}: "
                f"{(done.stdout + done.stderr).strip()[-1500:]}")
    return ""


@pytest.mark.timeout(1800)
def test_every_documented_command_that_can_run_on_one_machine_runs(tmp_path: Path) -> None:
    """Each command of a code block in README.md and docs/ runs as written (plus the block's
    ``<!-- docs: run with: ... -->`` arguments: tiny sizes, a step or two) in a folder with
    the repository's configs/ and hostfiles; a launch onto other hosts is planned with
    ``--dry-run``; the rest are marked ``<!-- docs: not run: why -->`` in the page (or hold a
    placeholder, or check other hosts) and are counted."""
    fixtures = tmp_path / "fixtures"
    (fixtures / "hostfiles").mkdir(parents=True)
    (fixtures / "hostfiles" / "cluster").write_text(
        (ROOT / "hostfiles" / "cluster.example").read_text())
    (fixtures / "hosts").write_text("node1 slots=2\nnode2 slots=2\n")
    shutil.copytree(ROOT / "configs", fixtures / "configs")
    bin_dir = str(Path(sys.executable).parent)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_"))},
           "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}
    shown = plans()
    counted = Counter(p.mode for p in shown)
    assert counted["run"] >= 8 and counted["dry-run"] >= 5, counted
    # Each page in a folder of its own, its commands in their order (a page is read alone).
    folders: dict[Path, Path] = {}
    for page in sorted({p.command.page for p in shown}):
        folders[page] = tmp_path / page.relative_to(ROOT).as_posix().replace("/", "-")
        shutil.copytree(tmp_path / "fixtures", folders[page])
    failed = [problem for p in shown if p.mode != "not run"
              for problem in [_run(p, folders[p.command.page], env)] if problem]
    assert not failed, "\n\n".join(failed)
    not_run = Counter(p.why for p in shown if p.mode == "not run")
    print(f"documented commands: {counted['run']} run, {counted['dry-run']} planned "
          f"(--dry-run), {counted['not run']} not run: " +
          "; ".join(f"{n} x {why}" for why, n in not_run.items()))


def test_a_block_marked_not_run_or_run_with_arguments_is_read_from_the_page(
        tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- docs: run with: --steps 1 -->\n\n"
                    "    dtrain launch --nproc-per-node 2 -- python -m trainer.train --model tiny\n"
                    "\n<!-- docs: not run: needs a GPU -->\n\n```bash\n"
                    "python -m trainer.train --model gpt-124m\n```\n\n"
                    "    python -m trainer.train --data FILE\n")
    got = [(p.mode, p.argv[-2:], p.why) for p in plans([page])]
    assert got == [("run", ("--steps", "1"), ""), ("not run", (), "needs a GPU"),
                   ("not run", (), "a placeholder stands for the user's value")]
