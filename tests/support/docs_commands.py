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
