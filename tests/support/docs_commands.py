"""The commands shown in the documentation (README and docs/), read from their pages: every
indented or fenced code block line and every inline code span that starts a `dtrain` or
``python -m trainer.*`` command, continuation lines joined. `tests/project/test_docs.py` checks them
against the code, so a renamed flag cannot leave a stale example.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
GENERATED = {ROOT / "docs" / "reference" / "cli.md", ROOT / "docs" / "reference" / "config.md"}

_STARTS = re.compile(r"^(?:\$ )?(dtrain |python3? -m (?:trainer|launcher)\b)")
_INLINE = re.compile(r"`((?:dtrain|python -m trainer\.)[^`]*)`")


@dataclass(frozen=True)
class Command:
    """One command as a page shows it."""

    page: Path
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def argv(self) -> list[str]:
        """The words, shell comments dropped; placeholders such as ``FILE`` stay words."""
        return shlex.split(self.text.removeprefix("$ "), comments=True)


def _code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, code) of every code block line, indented or fenced."""
    lines, fenced, out = text.splitlines(), False, []
    for number, raw in enumerate(lines, 1):
        if raw.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or raw.startswith("    "):
            out.append((number, raw.strip()))
    return out


def _joined(code: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Lines ending in a backslash joined with the next."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, line in code:
        if pending is not None:
            number, line = pending[0], pending[1] + " " + line
            pending = None
        if line.endswith("\\"):
            pending = (number, line[:-1].rstrip())
        else:
            out.append((number, line))
    return out


def commands(pages: list[Path] | None = None) -> list[Command]:
    """Every `dtrain` and ``python -m trainer`` command of the pages, generated pages excepted."""
    found = []
    for page in pages or PAGES:
        if page in GENERATED:
            continue
        text = page.read_text()
        for number, line in _joined(_code_lines(text)):
            if _STARTS.match(line):
                found.append(Command(page, number, line))
        for number, raw in enumerate(text.splitlines(), 1):
            if raw.startswith("    "):
                continue
            found += [Command(page, number, m.group(1)) for m in _INLINE.finditer(raw)
                      if " " in m.group(1)]
    return found


# Which documented commands run here, and how (`tests/project/test_docs.py` runs them). A page
# marks the code block below a comment line:
#   <!-- docs: not run: WHY -->        the block's commands cannot run on one machine (counted)
#   <!-- docs: run with: ARGS -->      ARGS are appended to each trainer command of the block
#                                      (tiny sizes, --steps 1), later flags winning
NOT_RUN = re.compile(r"<!-- docs: not run: (.+?) -->")
RUN_WITH = re.compile(r"<!-- docs: run with: (.+?) -->")
PLACEHOLDER = re.compile(r"\.\.\.|<[a-z-]+>|^[A-Z][A-Z_]{2,}(?::[A-Z]+)?$")
"""A word that stands for the user's value: FILE, HOST:PORT, <gpus>, ..."""
HOST_OPTIONS = ("--hostfile", "-f", "-H", "--hosts", "--rendezvous-port", "--launcher",
                "--nnodes")
"""`dtrain launch` options that name other hosts: such a launch is planned (``--dry-run``)."""


def in_block(command: Command) -> bool:
    """Whether the command is a line of a code block (not an inline span)."""
    lines = command.page.read_text().splitlines()
    return any(line == command.line for line, _ in _code_lines("\n".join(lines)))


def marker(command: Command) -> str:
    """The first line with text above the code block that holds the command ("" if none)."""
    lines = command.page.read_text().splitlines()
    index = command.line - 1
    fences = [i for i in range(index) if lines[i].lstrip().startswith("```")]
    if len(fences) % 2:  # inside a fenced block: it starts at the last fence above
        index = fences[-1]
    else:  # an indented block: up through its lines and the blank lines between them (a
        # marker inside a list item is indented like the item's text)
        while index > 0 and (lines[index - 1].startswith("    ") or not lines[index - 1].strip()) \
                and not lines[index - 1].lstrip().startswith("<!--"):
            index -= 1
    while index > 0 and not lines[index - 1].strip():
        index -= 1
    return lines[index - 1].strip() if index > 0 else ""


@dataclass(frozen=True)
class Plan:
    """How a documented command is checked: ``mode`` is "run" (as shown, plus the block's
    ``run with`` arguments), "dry-run" (a launch onto other hosts, planned only), or "not run"
    (``why``: the page's marker, or a placeholder in the command)."""

    command: Command
    mode: str
    argv: tuple[str, ...] = ()
    why: str = ""


def _with_extras(words: list[str], extras: list[str]) -> list[str]:
    """``extras`` appended to the trainer command inside ``words`` (a launch's program, or the
    command itself)."""
    if not extras:
        return words
    for at in range(len(words) - 2):
        if words[at] in ("python", "python3") and words[at + 1] == "-m" \
                and words[at + 2].startswith("trainer."):
            end = next((i for i in range(at + 3, len(words)) if words[i] in ("&", ">", "|")),
                       len(words))
            return [*words[:end], *extras, *words[end:]]
    return words


def plan(command: Command) -> Plan:
    """How ``command`` (a code block line) is checked here."""
    mark = marker(command)
    not_run = NOT_RUN.search(mark)
    if not_run:
        return Plan(command, "not run", why=not_run.group(1))
    if any(PLACEHOLDER.search(word) for word in command.argv()):
        return Plan(command, "not run", why="a placeholder stands for the user's value")
    extra = RUN_WITH.search(mark)
    words = _with_extras(command.argv(), shlex.split(extra.group(1)) if extra else [])
    if words[:2] == ["dtrain", "check"] and any(w in HOST_OPTIONS for w in words):
        return Plan(command, "not run", why="it checks the hosts of a hostfile or allocation")
    if words[:2] == ["dtrain", "launch"] and any(w in HOST_OPTIONS for w in words) \
            and "--" in words:
        return Plan(command, "dry-run", ("dtrain", "launch", "--dry-run", *words[2:]))
    return Plan(command, "run", tuple(words))


def plans(pages: list[Path] | None = None) -> list[Plan]:
    """Every code block command of the pages (generated pages excepted) and how it is checked."""
    return [plan(c) for c in commands(pages) if in_block(c)]
